"""Every plan of ``thinwire plan --json``, split into the lists a sweep runs them from.

    python bench/plan_split.py --plan docs/results/plan-cpu8m/10mbit-q64/plan.json \
        --slow-from 40 --slow-parts 2 --out docs/results/plan-cpu8m/10mbit-q64/plans

Writes ``OUT-fast.txt``, the plans predicted to step in under ``--slow-from`` seconds, in
the planner's order (the choice first), and ``OUT-slow-0.txt`` ... the slower ones dealt
in the planner's order into ``--slow-parts`` lists, each one ``thinwire bench --plans``
argument. Slow plans wait on the link with their ranks asleep, so two benches can run them
side by side (docs/planner-measurements.md, "10 Mbit/s: the probe and plan before the
sweep"); fast plans run alone. DGC runs in its steady state (``warmup_steps=0``), as the
planner predicts it; ``bench/plan_check.py`` strips that option again.

A sweep longer than a session goes on on another machine, calibrated anew there: split that
machine's plan JSON with ``--measured`` (the results.json of the runs so far: their plans
are left out) and ``--bridge N`` (the first N plans of its order are run again all the
same, so each machine measures its own choice beside its runners-up).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def as_bench_label(label: str) -> str:
    """The planner's label of a plan as the bench runs it (DGC without its warm-up)."""
    return label.replace("momentum=0.0)", "momentum=0.0,warmup_steps=0)")


def as_planner_label(label: str) -> str:
    """A label as the bench ran it, back as the planner wrote it."""
    return re.sub(r",?warmup_steps=0", "", label).replace("()", "")


def not_measured(ranked: list[dict], measured: set[str], bridge: int) -> list[dict]:
    """``ranked`` without the plans in ``measured`` (planner's labels), but for its first
    ``bridge`` plans, which stay whether measured or not."""
    return [r for place, r in enumerate(ranked) if place < bridge or r["plan"] not in measured]


def split(ranked: list[dict], slow_from_s: float, slow_parts: int) -> tuple[list, list]:
    """The fast plans' labels, and the slow ones dealt into ``slow_parts`` lists."""
    fast = [as_bench_label(r["plan"]) for r in ranked if r["prediction"]["step_s"] < slow_from_s]
    slow = [as_bench_label(r["plan"]) for r in ranked if r["prediction"]["step_s"] >= slow_from_s]
    return fast, [slow[part::slow_parts] for part in range(slow_parts)]


def main() -> None:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", required=True, help="thinwire plan --json output")
    parser.add_argument("--slow-from", type=float, default=40.0, help="predicted seconds a step")
    parser.add_argument("--slow-parts", type=int, default=2, help="lists to deal slow plans into")
    parser.add_argument("--out", required=True, help="prefix of the lists")
    parser.add_argument(
        "--measured",
        nargs="+",
        default=[],
        help="results.json of runs so far: leave their plans out",
    )
    parser.add_argument(
        "--bridge", type=int, default=0, help="keep the first N plans even if measured"
    )
    args = parser.parse_args()
    if args.slow_parts < 1 or args.slow_from <= 0 or args.bridge < 0:
        parser.error("--slow-parts must be >= 1, --slow-from above 0 and --bridge 0 or more")
    ranked = json.loads(Path(args.plan).read_text())["ranked"]
    measured = {
        as_planner_label(record["plan"])
        for path in args.measured
        for record in json.loads(Path(path).read_text())["records"]
    }
    unknown = measured - {r["plan"] for r in ranked}
    if unknown:
        parser.error(
            f"{len(unknown)} measured plan(s) the plan JSON does not rank (e.g. "
            f"{sorted(unknown)[0]}): pass a plan JSON of the same model and cluster"
        )
    everything = len(ranked)
    ranked = not_measured(ranked, measured, args.bridge)
    if args.measured:
        print(
            f"{everything - len(ranked)} of {everything} plans measured already and left out; "
            f"the first {min(args.bridge, everything)} kept as the bridge"
        )
    fast, slow = split(ranked, args.slow_from, args.slow_parts)
    Path(f"{args.out}-fast.txt").write_text(" ".join(fast) + "\n")
    for part, labels in enumerate(slow):
        Path(f"{args.out}-slow-{part}.txt").write_text(" ".join(labels) + "\n")
    steps_h = sum(r["prediction"]["step_s"] for r in ranked) / 3600
    print(
        f"{len(fast)} fast plans, {sum(map(len, slow))} slow in {args.slow_parts} lists; "
        f"{steps_h:.2f} h for one step of every plan (predicted)"
    )


if __name__ == "__main__":
    main()
