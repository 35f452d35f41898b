"""Four ways to time a small all-reduce, on every host's group at once (run as every rank).

    thinwire cluster up --hosts 2 --ranks-per-host 4 --bandwidth 1gbit --latency 1ms
    thinwire cluster run -- python bench/allreduce_timing.py
    thinwire cluster down

For 64 KB, 256 KB and 1 MB, an all-reduce among each host's ranks: one after a barrier
(median of 5, as ``thinwire probe`` timed it before 2026-11-28), 20 back to back (as
tensor parallelism issues them), host 0's group alone, and spaced by 20 ms sleeps (as
between a pipeline's computes). Each figure is the slowest rank's; rank 0 prints them.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def main() -> None:
    """Time the four ways (see the module docstring) and print them on rank 0."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "4"))
    groups = [dist.new_group(list(range(h, h + per_host))) for h in range(0, world, per_host)]
    mine = groups[rank // per_host]
    for nbytes in (65536, 262144, 1048576):
        data = torch.zeros(nbytes // 4)
        for _ in range(3):
            dist.all_reduce(data, group=mine)
        alone = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(data, group=mine)
            alone.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(data, group=mine)
        in_a_row = (time.perf_counter() - start) / 20
        dist.barrier()
        start = time.perf_counter()
        if rank < per_host:
            for _ in range(20):
                dist.all_reduce(data, group=mine)
        one_host = (time.perf_counter() - start) / 20
        spaced = []
        for _ in range(10):
            time.sleep(0.02)
            start = time.perf_counter()
            dist.all_reduce(data, group=mine)
            spaced.append(time.perf_counter() - start)
        figures = [
            _slowest(statistics.median(alone)),
            _slowest(in_a_row),
            _slowest(one_host),
            _slowest(statistics.median(spaced)),
        ]
        if rank == 0:
            ms = ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in zip(
                ("after a barrier", "back to back", "host 0 alone", "spaced"), figures, strict=True
            ))  # fmt: skip
            print(f"{nbytes} bytes: {ms}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
