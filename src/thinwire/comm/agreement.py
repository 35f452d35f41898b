"""The rank-agreement checks: do all ranks hold the same facts and settings?

Distributed code that starts from different models, options or checkpoints on different
ranks does not fail: it trains on garbage or hangs. Every front end therefore checks, once,
that the ranks agree, and names what differs:

- :func:`ranks_differing` compares *facts* (a parameter layout, a setup string) by digest,
  in one all-gather, and says which ranks differ in which fact;
- :func:`value_ranges` compares *numbers* (a step, a delay), in one all-reduce, and gives
  their lowest and highest value over the ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from thinwire.comm.collectives import control_device, run_collective


def digest(text: str) -> int:
    """A 64-bit signed digest of ``text`` (the same on every rank and machine)."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little", signed=True)


def parameter_layout(named: Iterable[tuple[str, Tensor]]) -> str:
    """Names, shapes and dtypes of ``(name, tensor)`` pairs, as one string to compare."""
    return ";".join(f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in named)


def ranks_differing(facts: Sequence[str], group: dist.ProcessGroup | None) -> list[list[int]]:
    """For each of ``facts``, the ranks of ``group`` whose fact differs from this rank's
    (empty lists where every rank agrees). Collective: one all-gather of the digests."""
    mine = torch.tensor([digest(f) for f in facts], dtype=torch.int64, device=control_device(group))
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    run_collective("the setup check", dist.all_gather, everyone, mine, group=group)
    return [
        [rank for rank, theirs in enumerate(everyone) if theirs[i] != mine[i]]
        for i in range(len(facts))
    ]


def value_ranges(
    values: Sequence[int], group: dist.ProcessGroup | None = None
) -> list[tuple[int, int]]:
    """The lowest and highest of each of ``values`` over the ranks of ``group``, from one
    all-reduce (max over ``[x, -x]``): equal on every rank where the ranks agree.
    Collective: every rank calls it with as many values."""
    probe = torch.tensor(
        [v for value in values for v in (int(value), -int(value))], device=control_device(group)
    )
    run_collective("a settings check", dist.all_reduce, probe, op=dist.ReduceOp.MAX, group=group)
    return [(-int(probe[2 * i + 1]), int(probe[2 * i])) for i in range(len(values))]
