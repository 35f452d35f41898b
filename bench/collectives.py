"""Collective latency benchmark: all-reduce, all-gather, all-to-all and broadcast, side by side.

    python bench/collectives.py --hosts 4 --bandwidth 1gbit --latency 50ms \
        --sizes 4000,40000,400000 --out results/collectives-50ms.json

On an emulated cluster (root; one rank per host, gloo), for each payload size in bytes
per rank, times the three ways thinwire's communicators move a round (median of
``--repeats`` runs after one warm-up, every run starting from a barrier, rank 0's
clock): ``all_reduce`` of the payload (the ring: 2 (N-1) steps), ``all_gather`` of it
(N-1 steps), ``all_to_all`` of N copies of it (one step: what the ``direct``
communicator does) and ``broadcast`` of it from rank 0 (what DDP does with the model's
buffers before each forward pass), timed until a one-element all-reduce after it
returns, so that every rank has it. Prints a table of milliseconds and writes them to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KINDS = ("all_reduce", "all_gather", "all_to_all", "broadcast")


def time_collectives(sizes: list[int], repeats: int) -> dict[int, dict[str, float]]:
    """Seconds of each collective kind for each payload size (bytes per rank); collective:
    every rank of the initialised process group calls it."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    timings: dict[int, dict[str, float]] = {}
    for nbytes in sizes:
        payload = torch.ones(max(nbytes // 4, 1))
        gathered = torch.empty(world * payload.numel())
        copies = payload.repeat(world)
        timings[nbytes] = {}
        for kind in KINDS:
            runs = []
            for _ in range(repeats + 1):
                dist.barrier()
                started = time.perf_counter()
                if kind == "all_reduce":
                    dist.all_reduce(payload)
                elif kind == "all_gather":
                    dist.all_gather_into_tensor(gathered, payload)
                elif kind == "all_to_all":
                    dist.all_to_all_single(gathered, copies)
                else:
                    dist.broadcast(payload, 0)
                    dist.all_reduce(torch.ones(1))  # returns once every rank has it
                runs.append(time.perf_counter() - started)
            timings[nbytes][kind] = statistics.median(runs[1:])
    return timings


def _worker(sizes: list[int], repeats: int, out: Path) -> None:
    """One rank (started by :func:`main` on each host): time, and on rank 0 write."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        timings = time_collectives(sizes, repeats)
        if dist.get_rank() == 0:
            out.write_text(json.dumps({str(k): v for k, v in timings.items()}))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Bring up the cluster, time the collectives on every host, print and save them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--latency", default="50ms")
    parser.add_argument("--sizes", default="4000,40000,400000", help="bytes per rank, commas")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/collectives.json"))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes must be integers separated by commas, got {args.sizes!r}")
    if not sizes or min(sizes) < 4:
        parser.error("--sizes needs at least one size of 4 bytes or more")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.worker is not None:
        _worker(sizes, args.repeats, args.worker)
        return 0

    from rich.console import Console
    from rich.table import Table

    from thinwire.cluster import EmulatedCluster, check_can_emulate
    from thinwire.launch import free_port

    reason = check_can_emulate()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        partial = Path(scratch) / "timings.json"
        command = [sys.executable, str(Path(__file__).resolve()), *_passed(args), "--worker"]
        with EmulatedCluster(args.hosts, args.bandwidth, args.latency) as cluster:
            codes = cluster.run([*command, str(partial)], port=free_port(), timeout=600)
        if any(codes) or not partial.exists():
            print(f"error: a rank failed (exit codes {codes})", file=sys.stderr)
            return 1
        timings = json.loads(partial.read_text())
    record: dict[str, Any] = {
        "hosts": args.hosts,
        "bandwidth": args.bandwidth,
        "latency": args.latency,
        "repeats": args.repeats,
        "seconds": timings,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    table = Table(title=f"{args.hosts} hosts, {args.bandwidth}, {args.latency} one-way: ms")
    table.add_column("bytes per rank", justify="right")
    for kind in KINDS:
        table.add_column(kind, justify="right")
    for nbytes, row in timings.items():
        table.add_row(nbytes, *(f"{row[kind] * 1e3:.1f}" for kind in KINDS))
    Console().print(table)
    print(f"results: {args.out}")
    return 0


def _passed(args: argparse.Namespace) -> list[str]:
    """The options a worker needs, as arguments."""
    return ["--sizes", args.sizes, "--repeats", str(args.repeats)]


if __name__ == "__main__":
    sys.exit(main())
