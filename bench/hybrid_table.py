"""Hybrid plans across bandwidths: one markdown table and one figure from the results of
``thinwire bench --plans --compute sleep`` runs (one run per bandwidth).

    python bench/hybrid_table.py \
        docs/results/hybrid-throughput-{10mbit,100mbit,1gbit}/results.json \
        --plot docs/results/hybrid-throughput.png

Per plan and bandwidth: tokens per second on the virtual accelerators, the speed-up over
dense data parallelism of the same run (the plan ``Nx1x1`` without a compressor), and the
bytes sent between hosts per step, measured (the kernel's socket counters) against the
cost model's count.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def load_runs(paths: list[Path]) -> list[dict[str, Any]]:
    """Each results file as ``{"bandwidth": ..., "records": [...]}``, in the order given."""
    runs = []
    for path in paths:
        data = json.loads(path.read_text())
        if data["config"].get("compute") != "sleep":
            raise SystemExit(f"{path}: not a --compute sleep run of --plans")
        runs.append({"bandwidth": data["config"]["bandwidth"], "records": data["records"]})
    return runs


def dense_data_parallel(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's pure data-parallel plan with dense gradients (the baseline)."""
    for record in records:
        degrees = record["degrees"]
        if degrees["pp"] == degrees["tp"] == 1 and ":" not in record["plan"]:
            return record
    raise SystemExit("every run needs the dense data-parallel plan (e.g. 8x1x1) as baseline")


def speedups(run: dict[str, Any]) -> dict[str, float]:
    """Each plan's tokens per second over the baseline's."""
    base = dense_data_parallel(run["records"])["tokens_per_s"]
    return {r["plan"]: r["tokens_per_s"] / base for r in run["records"]}


def table(runs: list[dict[str, Any]]) -> str:
    """The markdown table: one row per plan, a column group per bandwidth."""
    head = "| plan | " + " | ".join(
        f"{run['bandwidth']}: tokens/s | x dense DP | MB between hosts (model)" for run in runs
    )
    rule = "|---|" + "---:|---:|---:|" * len(runs)
    rows = [head + " |", rule]
    for i, record in enumerate(runs[0]["records"]):
        cells = []
        for run in runs:
            r = run["records"][i]
            if r["plan"] != record["plan"]:
                raise SystemExit("the runs must list the same plans in the same order")
            ratio = speedups(run)[r["plan"]]
            cells.append(
                f"{r['tokens_per_s']:.0f} | {ratio:.2f} | "
                f"{r['sent_between_hosts'] / 1e6:.1f} ({r['modelled_between_hosts'] / 1e6:.1f})"
            )
        rows.append(f"| {record['plan']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Speed-up over dense data parallelism per plan, a bar per bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = [r["plan"] for r in runs[0]["records"]]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(plans) + 1.5))
    height = 0.8 / len(runs)
    for k, run in enumerate(runs):
        ratios = speedups(run)
        positions = [i + k * height for i in range(len(plans))]
        ax.barh(positions, [ratios[p] for p in plans], height, label=run["bandwidth"])
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(plans))], plans, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("throughput over dense data parallelism (virtual accelerators, log scale)")
    ax.legend(title="between hosts", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    """Print the table; draw the figure with ``--plot``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    runs = load_runs(args.results)
    print(table(runs))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
