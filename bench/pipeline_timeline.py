"""Pipeline timelines side by side: the simulator's against a measured run, per plan.

    python bench/pipeline_timeline.py --results docs/results/recompute-51m-1gbit/results.json \
        --links docs/results/links-2x4-1gbit.json --plans 2x4x1/mb8/1f1b/rc1,1,1,1 \
        2x4x1/mb8/shifted-1f1b/rc1,0.75,0.5,0.25 --out docs/results/recompute-timelines.png

For each plan: on the left what the cost model's simulator says each pipeline stage
computes and when (forward, recomputation, backward of each micro-batch); on the right what
the virtual accelerators of the run's last step did (``thinwire bench --compute sleep``
notes every forward, recomputation and backward it sleeps, and since 2026-11-28 each
rank's data-parallel exchange and optimizer step after them), the first data-parallel
replica's ranks. Same time axis on both sides; the simulator's step and the measured one
in the titles.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from thinwire.bench.hybrid_predict import profiles_for, stage_costs
from thinwire.bench.step_phases import PHASES
from thinwire.parallel.plan_spec import parse_plan
from thinwire.plan.hybrid_cost import Degrees, predict_plan
from thinwire.plan.probe import LinkProbe

COLOURS = {"F": "#4c78a8", "R": "#f58518", "B": "#54a24b", "X": "#b279a2", "O": "#9d755d"}
NAMES = {"F": "forward", "R": "recompute", "B": "backward", **PHASES}


def measured_timeline(record: dict, plan) -> list[tuple[int, str, float, float]]:
    """The last step's computes of the first data-parallel replica: (stage, kind, start,
    end), from the step's start."""
    ranks = [s * plan.dp * plan.tp for s in range(plan.pp)]  # mesh (pp, dp, tp)
    events = []
    for rank in ranks:
        for stage, kind, start, end in record["timelines"][rank]:
            events.append((stage, kind, start, end))
    return events


def draw(axis, events, stages: int, title: str, span: float) -> None:
    """One timeline: a row per stage, a box per compute."""
    for stage, kind, start, end in events:
        axis.barh(stage, end - start, left=start, color=COLOURS[kind], edgecolor="white",
                  linewidth=0.3, height=0.8)  # fmt: skip
    axis.set_ylim(stages - 0.5, -0.5)
    axis.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    axis.set_xlim(0, span)
    axis.set_title(title, fontsize=9)
    axis.set_xlabel("seconds into the step")


def main() -> None:
    """Draw every requested plan's two timelines into one picture."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", required=True, help="a sweep's results.json")
    parser.add_argument("--links", required=True, help="a thinwire probe JSON of the cluster")
    parser.add_argument("--plans", nargs="+", required=True, help="plans of the sweep to draw")
    parser.add_argument("--cache", default="runs/stage-profiles")
    parser.add_argument("--out", required=True, help="the picture (PNG)")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sweep = json.loads(Path(args.results).read_text())
    records = {r["plan"]: r for r in sweep["records"]}
    probe = LinkProbe.load(args.links)
    figure, axes = plt.subplots(len(args.plans), 2, figsize=(13, 2.2 * len(args.plans) + 0.6),
                                squeeze=False)  # fmt: skip
    for row, spec in enumerate(args.plans):
        label = parse_plan(spec).spec()
        if label not in records:
            raise SystemExit(f"{spec} is not in {args.results}: it has {sorted(records)}")
        record, plan = records[label], parse_plan(spec)
        if not record.get("timelines"):
            raise SystemExit(f"{label}'s record has no timelines: run it again with this thinwire")
        degrees = Degrees(plan.dp, plan.pp, plan.tp, plan.microbatches, plan.schedule)
        costs = stage_costs(profiles_for(sweep["config"], label, Path(args.cache)),
                            record["stage_compute_s"])  # fmt: skip
        predicted = predict_plan(degrees, costs, probe)
        simulated = [(s, k, a, b) for s, k, _, a, b in predicted.timeline]
        measured = measured_timeline(record, plan)
        span = max(max(e[3] for e in simulated), max(e[3] for e in measured)) * 1.02
        draw(axes[row][0], simulated, plan.pp,
             f"{label}: simulated (pipeline {predicted.pipeline_s:.2f} s of a "
             f"{predicted.step_s:.2f} s step)", span)  # fmt: skip
        draw(axes[row][1], measured, plan.pp,
             f"{label}: measured (last step {record['steps_s'][-1]:.2f} s)", span)  # fmt: skip
    figure.legend(handles=[Patch(color=c, label=NAMES[k]) for k, c in COLOURS.items()],
                  loc="upper center", ncol=3, fontsize=8)  # fmt: skip
    figure.tight_layout(rect=(0, 0, 1, 0.95))
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
