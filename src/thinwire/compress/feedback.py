"""Error-feedback memories: none, the plain residual, and DGC's momentum-corrected memory.

Residual (error feedback, Seide et al. 2014; Karimireddy et al. 2019)::

    corrected = g + e          # compensate
    e = corrected - sent       # update: what the compressor dropped waits for next step

DGC (Lin et al. 2018), per tensor, with momentum ``m`` moved out of the optimizer::

    g = clip(g + wd * w, max_norm / sqrt(N))   # local gradient clipping
    u = m * u + g                              # momentum correction: accumulate velocity
    v = v + u                                  # accumulate (this is what is compressed)
    v[sent] = 0                                # residual update
    u[sent] = 0                                # momentum factor masking (if masking)

The optimizer must then apply the averaged ``v`` with plain SGD (no second momentum).
Tensors the compressor declines (1-D biases and norms) still get ``u`` and ``v`` but are
sent whole, so they see ordinary momentum SGD and no masking.
All buffers are fp32, so half-precision models keep full-precision residuals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.base import Exchanged, Memory, Slot, is_real


class NoMemory(Memory):
    """No error feedback: compress the gradient as it is (unbiased compressors, fp16)."""

    def compensate(self, grad: Tensor, slot: Slot, param: Tensor | None = None) -> Tensor:
        """Return the gradient in fp32, unchanged."""
        return grad if grad.dtype == torch.float32 else grad.float()

    def update(self, corrected: Tensor, sent: Exchanged, slot: Slot, compressed: bool) -> None:
        """Nothing to remember."""


class ResidualMemory(Memory):
    """Classic error feedback: add last step's residual, keep what was not sent."""

    def __init__(self) -> None:
        self.residuals: dict[str, Tensor] = {}

    def compensate(self, grad: Tensor, slot: Slot, param: Tensor | None = None) -> Tensor:
        """``residual += grad`` in place; the residual buffer now holds the corrected tensor."""
        residual = self.residuals.get(slot.key)
        if residual is None or residual.shape != grad.shape:
            residual = torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
            self.residuals[slot.key] = residual
        return residual.add_(grad)

    def update(self, corrected: Tensor, sent: Exchanged, slot: Slot, compressed: bool) -> None:
        """``residual = corrected - sent``; exact zeroing for sparsifiers."""
        _subtract_sent(corrected, sent)

    def forget(self, key: str) -> None:
        """Drop ``key``'s residual."""
        self.residuals.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        """The residual of every tensor key."""
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore residuals."""
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}


@dataclass
class DGCMemory(Memory):
    """DGC's memory: momentum correction, local clipping, momentum factor masking.

    Options:
        momentum: the momentum ``m`` DGC applies (the optimizer must not add its own).
        max_norm: clip each worker's gradient to norm ``max_norm / sqrt(N)`` per tensor
            before accumulation; ``None`` disables clipping.
        masking: zero the momentum of every sent entry (momentum factor masking, as
            published; off by default, see :class:`~thinwire.compress.dgc.DGC`).
        weight_decay: added to the gradient before momentum (``g + wd * w``).
    """

    momentum: float = 0.9
    max_norm: float | None = None
    masking: bool = False
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not is_real(self.momentum) or not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), got {self.momentum!r}")
        if self.max_norm is not None and not (is_real(self.max_norm) and self.max_norm > 0):
            raise ValueError(f"max_norm must be a number > 0 or None, got {self.max_norm!r}")
        if not is_real(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(
                f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}"
            )
        if not isinstance(self.masking, bool):
            raise ValueError(f"masking must be true or false, got {self.masking!r}")
        self.velocities: dict[str, Tensor] = {}
        self.accumulators: dict[str, Tensor] = {}

    def compensate(self, grad: Tensor, slot: Slot, param: Tensor | None = None) -> Tensor:
        """``u = m*u + clip(g + wd*w)``; ``v += u``; return ``v``."""
        u = self._buffer(self.velocities, slot.key, grad)
        v = self._buffer(self.accumulators, slot.key, grad)
        scale = 1.0
        if self.max_norm is not None:
            limit = self.max_norm / math.sqrt(slot.world_size)
            norm = float(torch.linalg.vector_norm(grad, dtype=torch.float32))
            if norm > limit:
                scale = limit / (norm + 1e-12)
        u.mul_(self.momentum).add_(grad, alpha=scale)
        if self.weight_decay and param is not None:
            u.add_(param.detach(), alpha=self.weight_decay * scale)
        return v.add_(u)

    def update(self, corrected: Tensor, sent: Exchanged, slot: Slot, compressed: bool) -> None:
        """Zero what was sent in ``v``; with masking, also in ``u`` (compressed tensors)."""
        _subtract_sent(corrected, sent)
        if not (self.masking and compressed):
            return
        u = self.velocities[slot.key]
        if sent.sent_indices is not None:
            u.view(-1).index_fill_(0, sent.sent_indices, 0.0)
        elif sent.local is not None:
            u.masked_fill_(sent.local != 0, 0.0)

    def forget(self, key: str) -> None:
        """Drop ``key``'s velocity and accumulator."""
        self.velocities.pop(key, None)
        self.accumulators.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        """Velocities ``u`` and accumulators ``v`` of every tensor key."""
        return {
            "velocities": {k: t.clone() for k, t in self.velocities.items()},
            "accumulators": {k: t.clone() for k, t in self.accumulators.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore velocities and accumulators."""
        self.velocities = {k: t.clone() for k, t in state.get("velocities", {}).items()}
        self.accumulators = {k: t.clone() for k, t in state.get("accumulators", {}).items()}

    @staticmethod
    def _buffer(store: dict[str, Tensor], key: str, like: Tensor) -> Tensor:
        buffer = store.get(key)
        if buffer is None or buffer.shape != like.shape:
            buffer = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
            store[key] = buffer
        return buffer


def _subtract_sent(corrected: Tensor, sent: Exchanged) -> None:
    """Turn ``corrected`` (a memory's own buffer) into the residual, in place."""
    if sent.sent_indices is not None:
        corrected.view(-1).index_fill_(0, sent.sent_indices, 0.0)
    elif sent.local is not None:
        corrected.sub_(sent.local)
    else:
        raise ValueError("an exchange reported neither what it sent nor its indices")
