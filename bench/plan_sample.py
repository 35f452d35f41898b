"""The plans a planner check runs: a sample of ``thinwire plan --json``'s order, in parts.

    python bench/plan_sample.py --plan docs/results/plan-steady-100mbit/plan.json \
        --parts 4 --out docs/results/plan-steady-100mbit/plans

Takes the planner's 8 best plans, then every 10th after them (its 18th, 28th, ...), and the
pure data-parallel references (dense, PowerSGD and DGC on every rank, where ranked), and
deals them into ``--parts`` lists (``OUT-0.txt``, ...), every ``parts``-th plan into the
same one, so that each part mixes fast and slow plans; each list is one ``thinwire bench
--plans`` argument. DGC runs in its steady state (``warmup_steps=0``), as the planner
predicts it; ``bench/plan_check.py`` strips that option again to match the planner's
labels.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: how many of the planner's best plans are taken, then the stride through the rest
BEST, STRIDE = 8, 10
#: the data-parallel references, if ranked (the planner's labels)
REFERENCES = (
    "{world}x1x1/mb1/1f1b",
    "{world}x1x1/mb1/1f1b:powersgd(rank=4)",
    "{world}x1x1/mb1/1f1b:dgc(density=0.01,momentum=0.0)",
)


def sample(ranked: list[str], world: int) -> list[str]:
    """The sample of ``ranked`` (labels, best first), labelled as the bench runs them."""
    places = [*range(BEST), *range(BEST + STRIDE - 1, len(ranked), STRIDE)]
    chosen = [ranked[p] for p in places if p < len(ranked)]
    for reference in REFERENCES:
        label = reference.format(world=world)
        if label in ranked and label not in chosen:
            chosen.append(label)
    return [label.replace("momentum=0.0)", "momentum=0.0,warmup_steps=0)") for label in chosen]


def main() -> None:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", required=True, help="thinwire plan --json output")
    parser.add_argument("--parts", type=int, default=4, help="lists to deal the plans into")
    parser.add_argument("--out", required=True, help="prefix of the lists (OUT-0.txt, ...)")
    args = parser.parse_args()
    if args.parts < 1:
        parser.error(f"--parts must be >= 1, got {args.parts}")
    planned = json.loads(Path(args.plan).read_text())
    cluster = planned["cluster"]
    world = cluster["hosts"] * cluster["ranks_per_host"]
    labels = sample([row["plan"] for row in planned["ranked"]], world)
    for part in range(args.parts):
        Path(f"{args.out}-{part}.txt").write_text(" ".join(labels[part :: args.parts]) + "\n")
    print(f"{len(labels)} plans in {args.parts} parts")


if __name__ == "__main__":
    main()
