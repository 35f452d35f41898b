"""The planner's predicted step time against the measured one, for one or more checks.

    python bench/plan_check_plot.py --out docs/results/plan-check.png \\
        "2 x 4, 100 Mbit/s=docs/results/plan-b2b-100mbit/check.json" \\
        "2 x 4, 1 Gbit/s=docs/results/plan-b2b-1gbit/check.json"

Each argument is ``LABEL=CHECK.json`` (what ``bench/plan_check.py --out`` writes). One
point a plan measured, both axes logarithmic, with the line where prediction and
measurement agree and the band of 25 % either side (issue 27's bound on every plan);
each check's choice ringed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: the error every plan's prediction must stay within (issue 27)
BAND = 0.25


def plot(checks: list[tuple[str, dict]], out: Path) -> Path:
    """Draw ``checks`` ((label, plan_check summary) pairs) into ``out`` (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not checks:
        raise ValueError("nothing to plot: pass LABEL=CHECK.json at least once")
    figure, axes = plt.subplots(figsize=(6.5, 6))
    low, high = float("inf"), 0.0
    for label, summary in checks:
        rows = summary["rows"]
        measured = [r["measured_s"] for r in rows]
        predicted = [r["predicted_s"] for r in rows]
        worst, median = summary["max_abs_error"], summary["median_abs_error"]
        points = axes.scatter(
            measured,
            predicted,
            s=18,
            label=f"{label}: {len(rows)} plans, median {median:.0%}, worst {worst:.0%}",
        )
        chosen = [r for r in rows if r["place"] == 1]
        for r in chosen:
            axes.scatter(
                [r["measured_s"]], [r["predicted_s"]], s=120, facecolors="none",
                edgecolors=points.get_facecolor()[0], linewidths=1.5,
            )  # fmt: skip
        low = min(low, *measured, *predicted)
        high = max(high, *measured, *predicted)
    line = [low / 1.3, high * 1.3]
    axes.plot(line, line, color="black", linewidth=0.8)
    axes.fill_between(
        line, [x * (1 - BAND) for x in line], [x * (1 + BAND) for x in line],
        color="grey", alpha=0.15, label=f"within {BAND:.0%}",
    )  # fmt: skip
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("measured step, s (emulated hosts, virtual accelerators)")
    axes.set_ylabel("predicted step, s (planner)")
    axes.set_title("The planner against the runs (ringed: its choice)")
    axes.legend(fontsize=7, loc="upper left")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


def main() -> None:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checks", nargs="+", help="LABEL=CHECK.json, one per setting")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args()
    checks = []
    for argument in args.checks:
        label, sep, path = argument.partition("=")
        if not sep or not path:
            parser.error(f"{argument!r} is not LABEL=CHECK.json")
        checks.append((label, json.loads(Path(path).read_text())))
    print(f"plot: {plot(checks, Path(args.out))}")


if __name__ == "__main__":
    main()
