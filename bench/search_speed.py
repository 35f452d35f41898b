"""How long the planner's search takes: every plan of a cluster of HOSTS x RANKS ranks,
on nominal links, for a small GPT of many blocks (the search's time depends on the number
of plans, blocks and pipelines that share links, not on the model's width).

    python bench/search_speed.py --hosts 2 --ranks-per-host 4      # 8 ranks
    python bench/search_speed.py --hosts 128 --ranks-per-host 8    # 1024 ranks

The profiles (cached in runs/plan-profiles) are taken first and not timed; the search is
timed three times and the median printed, with the number of plans it ranked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from thinwire.plan.hybrid_command import plan_for
from thinwire.plan.model_source import ModelSource
from thinwire.plan.nominal_links import nominal_probe
from thinwire.plan.search import SearchSpace, search


def main() -> None:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=4)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--out", default="", help="append the result here (JSON lines)")
    args = parser.parse_args()
    model = {"dim": 32, "layers": args.layers, "heads": 4, "seq_len": 16, "vocab": 256,
             "batch_size": args.batch_size}  # fmt: skip
    probe = nominal_probe(args.hosts, args.ranks_per_host, 1e9, 1e-4)
    space = SearchSpace()
    result, costs = plan_for(
        ModelSource("gpt", model), probe, None, space, repeats=1, cache=Path("runs/plan-profiles")
    )
    times = []
    for _ in range(3):
        start = time.perf_counter()
        result = search(costs, probe, None, space)
        times.append(time.perf_counter() - start)
    summary = {
        "ranks": args.hosts * args.ranks_per_host,
        "hosts": args.hosts,
        "blocks": costs.blocks,
        "plans": len(result.prepared),
        "search_s": statistics.median(times),
        "chosen": result.chosen.label,
    }
    print(json.dumps(summary))
    if args.out:
        with Path(args.out).open("a") as out:
            out.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
