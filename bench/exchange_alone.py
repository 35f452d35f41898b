"""A data-parallel exchange alone, on the groups a 4x2x1 plan's stages use: four ranks
inside each of two emulated hosts, both hosts at once or one.

    python bench/exchange_alone.py --params 7400000 --out exchange-alone.json

Each rank holds a stand-in for one pipeline stage (four bias-free square linear layers of
``--params`` parameters in all) under a dense :class:`thinwire.DistributedOptimizer`
on its host's group, and times, after a barrier: ``torch.distributed.all_reduce`` of one
flat tensor of those parameters (``raw``), and the optimizer's ``synchronize`` (the engine's
exchange: buckets, the all-reduce, the gradients written back), with both hosts' groups
at once (``both``) or only the first host's (``one_host``). The median of five timed
repeats (one before them untimed), per rank; printed: the slowest rank's and the median.
What it is for: the planner's exchange of such a stage against the same exchange inside a
sweep's step (docs/planner-measurements.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from thinwire import DistributedOptimizer
from thinwire.cluster import EmulatedCluster
from thinwire.launch import LocalPool, Placement

MODES = ("raw_both", "sync_both", "raw_one_host", "sync_one_host")


def time_exchanges(rank: int, world: int, params: int, repeats: int = 6) -> dict[str, float]:
    """This rank's median seconds of each of :data:`MODES` (see the module's docstring)."""
    torch.set_num_threads(1)
    groups = [dist.new_group(list(range(h * 4, h * 4 + 4))) for h in range(world // 4)]
    group = groups[rank // 4]
    width = int((params / 4) ** 0.5)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(4)])
    optimizer = DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), model, "none", group=group
    )
    flat = torch.randn(sum(p.numel() for p in model.parameters()))
    medians = {}
    for mode in MODES:
        active = mode.endswith("both") or rank < 4
        seconds = []
        for _ in range(repeats):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            dist.barrier()
            start = time.perf_counter()
            if active and mode.startswith("raw"):
                dist.all_reduce(flat, group=group)
            elif active:
                optimizer.synchronize()
            seconds.append(time.perf_counter() - start)
            dist.barrier()
        medians[mode] = statistics.median(seconds[1:])
    return medians


def main() -> None:
    """Parse the arguments, run the eight ranks on two emulated hosts, print and save."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=7_400_000)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--latency", default="1ms")
    parser.add_argument("--out", type=Path, default=Path("exchange-alone.json"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cluster = EmulatedCluster(2, args.bandwidth, args.latency, ranks_per_host=4)
    with cluster, LocalPool(8, placement=Placement.on(cluster)) as pool:
        per_rank = pool.run(time_exchanges, args.params, timeout=600)
    summary = {"params": args.params, "bandwidth": args.bandwidth, "per_rank": per_rank}
    for mode in MODES:
        values = [r[mode] for r in (per_rank if mode.endswith("both") else per_rank[:4])]
        median = statistics.median(values)
        summary[mode] = {"slowest_s": max(values), "median_s": median}
        print(f"{mode:14s} slowest rank {max(values):.3f} s, median {median:.3f} s")
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
