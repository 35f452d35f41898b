"""Finiteness checks: whether gradients hold a NaN or an infinity, on the host or as a
device flag that is not read back (a GPU's host does not wait for it)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def all_finite(tensor: Tensor) -> bool:
    """Whether every entry of ``tensor`` is finite, usually for the price of one sum.

    A NaN or infinite entry makes the sum NaN or infinite, so a finite sum proves every
    entry finite (a tenth of the time of ``torch.isfinite(tensor).all()``, which writes a
    mask). Only a sum that is not finite, from such an entry or from finite entries whose
    sum overflowed, pays for the entry-wise check.
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    accumulate = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    if math.isfinite(tensor.sum(dtype=accumulate).item()):  # one read, no more kernels
        return True
    return bool(torch.isfinite(tensor).all())


def not_finite_flag(tensors: Sequence[Tensor]) -> Tensor:
    """Whether some value of the (non-empty, floating) ``tensors`` is NaN or infinite, as
    a bool tensor on their device, not read back, in a fixed handful of kernels: their
    largest magnitudes in one multi-tensor norm (a NaN or an infinity in a tensor makes
    its norm so, and a maximum cannot overflow), then ``x - x != 0``, true only for a
    value that is not finite."""
    if len(tensors) == 1:  # one value: its flag needs no reduction
        largest = torch.linalg.vector_norm(tensors[0], float("inf"))
        return (largest - largest).ne(0)
    norms = torch._foreach_norm(list(tensors), float("inf"))
    if len({t.dtype for t in norms}) > 1 or len({t.device for t in norms}) > 1:
        norms = [t.float().to(norms[0].device) for t in norms]
    largest = torch.stack(norms)
    return (largest - largest).ne(0).any()


class FiniteChecks:
    """Which of several tensors hold a NaN or infinite entry.

    On the CPU each tensor is checked when it is :meth:`add`-ed (:func:`all_finite`), so
    nothing that writes it later can hide the entry. On a GPU a check per tensor is a
    device flag and a few kernels; with ``defer`` the tensors are only noted, and
    :meth:`verdict` checks all of them at once (their largest magnitudes in one
    multi-tensor norm, a NaN or an infinity in any shows there) into one device flag that
    is not read back, so that an exchange can carry it (a poisoned payload) and the host
    learns the outcome once per step. Call :meth:`verdict` before anything writes the
    tensors. :meth:`failed` names the failed ones (reading every check: for a refused
    step). :meth:`add_together` checks several tensors that lie in one (flat or stacked)
    tensor with one check, and looks at them one by one only when it fails."""

    def __init__(self, defer: bool = False) -> None:
        self._defer = defer
        self._failed: list[int] = []
        self._queued: dict[torch.device, list[tuple[list[int], Tensor, Callable]]] = {}
        self._noted: list[tuple[list[int], Tensor, Callable]] = []

    def add(self, index: int, tensor: Tensor) -> None:
        """Check ``tensor`` (known as ``index``) as it is now."""
        self.add_together([index], tensor, lambda: [tensor])

    def add_together(
        self, indices: Sequence[int], whole: Tensor, pieces: Callable[[], Sequence[Tensor]]
    ) -> None:
        """Check the tensors that ``pieces()`` returns (known as ``indices``), which are
        parts of (or copies of parts of) ``whole`` and are not written before
        :meth:`failed`; ``pieces`` is called only if ``whole`` is not finite."""
        if not whole.is_floating_point() or whole.numel() == 0:
            return
        if self._defer:
            self._noted.append((list(indices), whole, pieces))
        elif whole.device.type == "cpu":
            if not all_finite(whole):
                self._failed += _not_finite(indices, pieces())
        else:
            flag = torch.isfinite(whole).all()
            self._queued.setdefault(whole.device, []).append((list(indices), flag, pieces))

    def verdict(self) -> bool | Tensor:
        """Whether some tensor failed: ``True``/``False`` where that is known on the host,
        else a device bool tensor (nothing read back)."""
        if self._failed:
            return True
        flags = [flag for entries in self._queued.values() for _, flag, _ in entries]
        bad = [~flag for flag in flags]
        if self._noted:
            bad.append(not_finite_flag([whole for _, whole, _ in self._noted]))
        if not bad:
            return False
        if len({flag.device for flag in bad}) > 1:  # on several devices: gather on one
            bad = [flag.to(bad[0].device) for flag in bad]
        return torch.stack(bad).any() if len(bad) > 1 else bad[0]

    def failed(self) -> list[int]:
        """The indices of the tensors that were not finite, in increasing order."""
        failed = list(self._failed)
        for entries in self._queued.values():
            finite = torch.stack([flag for _, flag, _ in entries]).tolist()
            for (indices, _, pieces), ok in zip(entries, finite, strict=True):
                if not ok:
                    failed += _not_finite(indices, pieces())
        for indices, whole, pieces in self._noted:
            if not all_finite(whole):
                failed += _not_finite(indices, pieces())
        return sorted(failed)


def _not_finite(indices: Sequence[int], pieces: Sequence[Tensor]) -> list[int]:
    return [i for i, piece in zip(indices, pieces, strict=True) if not all_finite(piece)]
