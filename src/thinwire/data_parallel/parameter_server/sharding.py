"""Which server shard owns which parameter: balanced by size, the same on every rank."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor, nn


def assign_shards(parameters: list[tuple[str, nn.Parameter]], servers: int) -> list[list[int]]:
    """Indices into ``parameters`` for each of ``servers`` shards: largest parameters
    first, each to the shard with the fewest elements so far (ties: the lower shard);
    every shard keeps its parameters in model order. Deterministic, so every rank
    computes the same split."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers!r}")
    if servers > len(parameters):
        raise ValueError(
            f"{servers} servers for {len(parameters)} parameters: a shard would be empty; "
            f"use at most {len(parameters)} servers"
        )
    loads = [0] * servers
    shards: list[list[int]] = [[] for _ in range(servers)]
    by_size = sorted(range(len(parameters)), key=lambda i: (-parameters[i][1].numel(), i))
    for index in by_size:
        target = min(range(servers), key=lambda s: (loads[s], s))
        shards[target].append(index)
        loads[target] += parameters[index][1].numel()
    return [sorted(shard) for shard in shards]


def wire_dtype(params: Sequence[Tensor]) -> torch.dtype:
    """The dtype a shard's parameters travel in from its server to the workers: the one
    every parameter's dtype converts to without loss (fp64 weights are not rounded to fp32,
    bf16 ones take half the bytes)."""
    return functools.reduce(torch.promote_types, (p.dtype for p in params), params[0].dtype)
