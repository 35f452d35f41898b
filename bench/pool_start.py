"""What it costs to start a pool's ranks: ``spawn`` against the preloaded ``forkserver``.

    python bench/pool_start.py --world-size 4 --pools 3 --out docs/results/pool-start.json

For each start method (alternating, each in a fresh interpreter so that neither inherits
the other's server), makes ``--pools`` pools of ``--world-size`` ranks one after another
and runs one all-reduce on each. Records the wall time from asking for the pool to the
all-reduce's result, and the CPU seconds each rank spent from its own start until then
(a forked rank's counters start at the fork, so the server's one ``import torch`` is
counted separately, as ``server_cpu_s``, once per interpreter). The suite and the bench
start several hundred ranks, so this is most of what ``make test`` spends outside the
tests' own work.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _ready(rank: int, world_size: int) -> float:
    """One all-reduce, then this rank's CPU seconds since it started."""
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == world_size
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _one_method(world_size: int, pools: int) -> dict:
    """Run in a fresh interpreter with ``THINWIRE_START_METHOD`` set: time ``pools`` pools."""
    from thinwire.launch import LocalPool

    walls, rank_cpu = [], []
    for _ in range(pools):
        start = time.perf_counter()
        with LocalPool(world_size) as pool:
            cpu = pool.run(_ready)
        walls.append(time.perf_counter() - start)
        rank_cpu.extend(cpu)
    return {"wall_s_per_pool": walls, "rank_cpu_s": rank_cpu, "server_cpu_s": _server_cpu_s()}


def _server_cpu_s() -> float:
    """CPU seconds of this interpreter's forkserver so far (0 where none runs: spawn)."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    """Measure both start methods and write the JSON (and print a summary)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--pools", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per method")
    parser.add_argument("--out", type=Path, default=Path("pool-start.json"))
    parser.add_argument("--child", choices=["spawn", "forkserver"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.pools < 1 or args.repeats < 1:
        parser.error("--world-size, --pools and --repeats must be at least 1")
    if args.child:
        print(json.dumps(_one_method(args.world_size, args.pools)))
        return
    runs: dict[str, list[dict]] = {"spawn": [], "forkserver": []}
    for _ in range(args.repeats):
        for method in runs:
            env = {**os.environ, "THINWIRE_START_METHOD": method, "OMP_NUM_THREADS": "1"}
            sizes = ["--world-size", str(args.world_size), "--pools", str(args.pools)]
            command = [sys.executable, __file__, "--child", method, *sizes]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            runs[method].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = {}
    for method, found in runs.items():
        walls = [w for run in found for w in run["wall_s_per_pool"]]
        cpus = [c for run in found for c in run["rank_cpu_s"]]
        summary[method] = {
            "wall_s_per_pool_median": statistics.median(walls),
            "rank_cpu_s_median": statistics.median(cpus),
            "server_cpu_s_median": statistics.median(run["server_cpu_s"] for run in found),
        }
    result = {"world_size": args.world_size, "pools": args.pools, "runs": runs,
              "summary": summary}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    spawn, fork = summary["spawn"], summary["forkserver"]
    for method, row in summary.items():
        print(f"{method:>10}: {row['wall_s_per_pool_median']:.2f} s a pool of "
              f"{args.world_size}, {row['rank_cpu_s_median']:.2f} s of CPU a rank")  # fmt: skip
    print(f"forkserver: {spawn['wall_s_per_pool_median'] / fork['wall_s_per_pool_median']:.1f}x "
          f"less wall, {spawn['rank_cpu_s_median'] / fork['rank_cpu_s_median']:.1f}x less CPU "
          "a rank")  # fmt: skip


if __name__ == "__main__":
    main()
