"""What a training step keeps for its backward pass, measured: every tensor autograd saves
goes through ``torch.autograd.graph.saved_tensors_hooks``; :class:`SavedActivations`
counts each storage once while the graph holds it and records the peak.

    with SavedActivations() as saved:
        loss = trainer.step(tokens, targets)
    saved.peak_bytes

Under a pipeline schedule the peak is what the micro-batches in flight hold together
(1F1B: up to ``pp - stage`` of them on a stage; GPipe: all).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from torch import Tensor
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _Saved:
    """What the graph holds instead of the tensor (its release is the tensor's)."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


class SavedActivations:
    """Peak bytes of the tensors autograd saves inside the ``with`` block, less those in
    ``exclude`` (the parameters: they are held anyway, and counted as such)."""

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._excluded = {_local(t).untyped_storage().data_ptr() for t in exclude}
        self.current_bytes = 0
        self.peak_bytes = 0
        self._holders: dict[int, int] = {}  # storage address -> how many holders
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: Tensor) -> _Saved | Tensor:
        storage = _local(tensor).untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded:
            return tensor
        if self._holders.get(key, 0) == 0:
            self.current_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        self._holders[key] = self._holders.get(key, 0) + 1
        holder = _Saved(tensor)
        weakref.finalize(holder, self._release, key, storage.nbytes())
        return holder

    def _release(self, key: int, nbytes: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            self.current_bytes -= nbytes

    @staticmethod
    def _unpack(holder: _Saved | Tensor) -> Tensor:
        return holder.tensor if isinstance(holder, _Saved) else holder

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
