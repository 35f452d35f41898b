"""What ``thinwire bench --step-budget`` would have reported for runs that took every step.

Reads sleeping sweeps' ``results.json`` (each plan's ``steps_s`` kept), applies the
budget's rule to each plan's first step (:func:`thinwire.bench.step_budget.steps_within`),
and compares the median of the steps the budget keeps with the median of all timed steps:

    python bench/step_budget_check.py --budget 120 docs/results/**/results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from thinwire.bench.step_budget import steps_within


def shortened_rows(paths: list[Path], budget_s: float, least_steps: int) -> list[dict]:
    """Per plan the budget would have cut: its first step, both medians and their ratio."""
    rows = []
    for path in paths:
        data = json.loads(path.read_text())
        config = data.get("config", {}) if isinstance(data, dict) else {}
        if config.get("compute") != "sleep":
            continue
        untimed = config.get("untimed_steps", 3)
        for record in data.get("records", []):
            steps = record.get("steps_s") or []
            # every step the run asked for (not one a budget already cut)
            if len(steps) < least_steps or len(steps) != config.get("steps", len(steps)):
                continue
            count = steps_within(steps[0], len(steps), untimed, budget_s)
            if not count.shortened:
                continue
            full = statistics.median(steps[untimed:])
            cut = statistics.median(steps[count.untimed : count.steps])
            rows.append({
                "results": str(path), "plan": record["plan"], "first_s": steps[0],
                "steps": count.steps, "full_s": full, "cut_s": cut, "error": cut / full - 1,
            })  # fmt: skip
    return rows


def main() -> int:
    """Print the comparison; 1 when no plan would have been cut."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--budget", type=float, required=True, metavar="SECONDS")
    parser.add_argument("--least-steps", type=int, default=8, help="runs of this many or more")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    rows = shortened_rows(sorted(set(args.results)), args.budget, args.least_steps)
    for row in rows:
        print(
            f"{row['plan']:48s} first {row['first_s']:6.1f} s  all {row['full_s']:7.2f}  "
            f"{row['steps']} steps {row['cut_s']:7.2f}  {100 * row['error']:+5.1f} %  "
            f"{row['results']}"
        )
    if not rows:
        print(f"no plan of these runs would have been cut by a {args.budget:g} s budget")
        return 1
    errors = [abs(r["error"]) for r in rows]
    print(
        f"{len(rows)} plans cut by a {args.budget:g} s budget: the kept steps' median against "
        f"all timed steps' {100 * statistics.median(errors):.2f} % at the median, "
        f"{100 * max(errors):.2f} % at most"
    )
    if args.out:
        args.out.write_text(json.dumps({"budget_s": args.budget, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
