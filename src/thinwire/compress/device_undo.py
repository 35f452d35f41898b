"""Putting a step's state back without reading its verdict: ``torch.where`` on a flag.

A step refused on the device (a GPU's finiteness verdict that the host does not wait for)
must leave no trace, yet nobody knows on the host whether it was refused. So every state
tensor the step wrote takes ``where(refused, before, written)`` in place: the step's
values where the flag is false, the values from before it where it is true (a NaN the
refused step wrote is dropped with the rest). :func:`where_many` does it for many tensors
in a fixed handful of kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def where_many(refused: Tensor, befores: Sequence[Tensor], afters: Sequence[Tensor]) -> None:
    """Set each ``afters[i]`` to ``before[i]`` wherever the bool flag ``refused`` (one
    value, on their device) is true, in place, reading nothing back; tensors of one dtype
    go together through one flat ``where`` (``cat``, ``where``, one multi-tensor copy)."""
    if len(befores) != len(afters):
        raise ValueError(f"{len(befores)} tensors from before the step for {len(afters)} after")
    for before, after in zip(befores, afters, strict=True):
        if before.shape != after.shape:
            raise ValueError(
                f"cannot put a {tuple(before.shape)} state back into {tuple(after.shape)}"
            )
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, after in enumerate(afters):
        by_dtype.setdefault(after.dtype, []).append(i)
    for members in by_dtype.values():
        if len(members) == 1:
            i = members[0]
            torch.where(refused, befores[i].to(afters[i].dtype), afters[i], out=afters[i])
            continue
        now = torch.cat([afters[i].reshape(-1) for i in members])
        then = torch.cat([befores[i].reshape(-1).to(now.dtype) for i in members])
        torch.where(refused, then, now, out=now)
        pieces = now.split([afters[i].numel() for i in members])
        torch._foreach_copy_(
            [afters[i] for i in members],
            [p.view(afters[i].shape) for p, i in zip(pieces, members, strict=True)],
        )
