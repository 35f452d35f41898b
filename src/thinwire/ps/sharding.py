"""Which server shard owns which parameter: balanced by size, the same on every rank."""

from __future__ import annotations

from torch import nn


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
