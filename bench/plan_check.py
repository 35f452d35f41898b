"""The planner against measurement: ``thinwire plan --json`` beside a ``thinwire bench --plans
--compute sleep`` sweep of the plans it ranked.

    python bench/plan_check.py --plan docs/results/plan-25m-100mbit.json \
        --results docs/results/plan-check-100mbit-*/results.json \
        --out docs/results/plan-check-100mbit.json

A sweep that ran on more than one machine (sessions land on different CPUs) is checked
with one ``--calibration PLAN.json RESULTS.json...`` per machine: each machine's probe,
profiles and plan, taken there before its runs, against the runs made there.

For every plan measured: its place in the planner's order, predicted and measured step
time and peak memory per rank; then how far the planner's choice is from the fastest plan
measured, the median and worst error, and Spearman's correlation between the planner's
order and the measured one. The planner's figures come from its own probe and profiles,
taken before the sweep; nothing of the sweep goes into them. A plan measured in more
than one run (run again beside plans a later planner put first) counts once: the median
of its runs' step times, the largest of their peaks.

Where the sweep noted its ranks' exchange and optimizer step (runs since 2026-11-28), each
row also splits the step as the model does, predicted beside measured (the measured along
the critical path of the run's last step): the pipeline, the data-parallel exchange and
the optimizer step. Where it timed each rank's exchange on every step and then alone
(runs since 2026-11-29), a row also puts the model's exchange beside the slowest rank's
inside the steps and alone (every stage's groups at once, and one stage's at a time).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from thinwire.bench.hybrid_predict import spearman
from thinwire.cluster.units import parse_bytes

#: options the sweep adds for measuring a steady state, which the planner's spec leaves out
_MEASUREMENT_ONLY = re.compile(r",?warmup_steps=0")


def _spec(label: str) -> str:
    return _MEASUREMENT_ONLY.sub("", label).replace("()", "")


def check(plan_json: Path, results: Path | list[Path], memory_limit: int | None = None) -> dict:
    """The comparison (see the module docstring); with ``memory_limit``, which plans the
    planner says fit it and which the runs show fit it."""
    files = results if isinstance(results, list) else [results]
    return check_calibrations([(plan_json, files)], memory_limit)


def check_calibrations(
    calibrations: list[tuple[Path, list[Path]]], memory_limit: int | None = None
) -> dict:
    """The comparison for a sweep run on more than one machine: each ``(plan JSON, its
    results)`` pair is a calibration (probe, profiles and plan taken on one machine before
    the runs there) and the runs on that machine. Every run is held against its own
    machine's prediction; the choice against the fastest plan measured on the same machine;
    the errors, Spearman's correlation and the memory check over every row together. A plan
    run on two machines is a row for each."""
    if not calibrations:
        raise ValueError("no calibration: pass a plan JSON and the results measured with it")
    rows: list[dict] = []
    by_calibration = []
    for index, (plan_json, files) in enumerate(calibrations, 1):
        group = _rows(plan_json, files, index)
        best = min(group, key=lambda r: r["measured_s"])
        chosen = next((r for r in group if r["place"] == 1), None)
        by_calibration.append(
            {
                "calibration": index,
                "plan": str(plan_json),
                "results": [str(path) for path in files],
                "plans": len(group),
                "chosen": None if chosen is None else chosen["plan"],
                "best_measured": best["plan"],
                "chosen_over_best": (
                    None if chosen is None else chosen["measured_s"] / best["measured_s"] - 1
                ),
            }
        )
        rows += group
    measured_choices = [c for c in by_calibration if c["chosen_over_best"] is not None]
    headline = (  # with several machines, the one where the choice did worst
        max(measured_choices, key=lambda c: c["chosen_over_best"])
        if measured_choices
        else by_calibration[0]
    )
    errors = [abs(r["error"]) for r in rows]
    peaks = [abs(r["peak_error"]) for r in rows]
    limit = None
    if memory_limit is not None:
        limit = {
            "bytes": memory_limit,
            "said_to_fit": [r["plan"] for r in rows if r["predicted_peak_bytes"] <= memory_limit],
            "said_not_to_fit": [
                r["plan"] for r in rows if r["predicted_peak_bytes"] > memory_limit
            ],
            "wrong": [
                r["plan"]
                for r in rows
                if (r["predicted_peak_bytes"] <= memory_limit)
                != (r["measured_peak_bytes"] <= memory_limit)
            ],
        }
    return {
        "memory_limit": limit,
        "plan": by_calibration[0]["plan"],
        "results": [path for c in by_calibration for path in c["results"]],
        "calibrations": by_calibration,
        "plans": len({r["plan"] for r in rows}),
        "rows": rows,
        "chosen": headline["chosen"],
        "best_measured": headline["best_measured"],
        "chosen_over_best": headline["chosen_over_best"],
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "spearman": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
        if len(rows) > 1
        else None,
        "median_abs_peak_error": statistics.median(peaks),
        "max_abs_peak_error": max(peaks),
    }


def _rows(plan_json: Path, files: list[Path], calibration: int) -> list[dict]:
    """One row a plan measured with the predictions of ``plan_json``, in its order."""
    planned = json.loads(plan_json.read_text())
    order = {row["plan"]: (place, row) for place, row in enumerate(planned["ranked"], 1)}
    records = [r for path in files for r in json.loads(path.read_text())["records"]]
    runs: dict[str, list[dict]] = {}
    for record in records:
        label = _spec(record["plan"])
        if label not in order:
            raise ValueError(
                f"{record['plan']} was measured but {plan_json} does not rank it: "
                "pass the plan JSON of the calibration the runs were made with"
            )
        runs.setdefault(label, []).append(record)
    rows = []
    for label, measured in runs.items():
        place, row = order[label]
        predicted = row["prediction"]
        step_s = statistics.median(r["step_s"] for r in measured)  # a plan run again: all
        peak = max(r["peak_memory_bytes"] for r in measured)
        rows.append(
            {
                "plan": label,
                "calibration": calibration,
                "place": place,
                "runs": len(measured),
                "predicted_s": predicted["step_s"],
                "measured_s": step_s,
                "error": predicted["step_s"] / step_s - 1,
                "predicted_peak_bytes": predicted["peak_memory_bytes"],
                "measured_peak_bytes": peak,
                "peak_error": predicted["peak_memory_bytes"] / peak - 1,
                "parts": _parts(predicted, measured[-1]),
                "exchange": _exchange(predicted, measured[-1]),
            }
        )
    if not rows:
        raise ValueError(f"{', '.join(map(str, files))} hold no measured plan")
    rows.sort(key=lambda r: r["place"])
    return rows


def _parts(predicted: dict, record: dict) -> dict | None:
    """The step split as the model splits it, predicted and measured (``None`` where the
    run noted no exchange or optimizer step). Measured along the critical path of the
    last step: the pipeline until the last rank's last compute ends, the exchange until
    the last rank's exchange ends, the optimizer until the last rank's step ends."""
    timelines = [t for t in record.get("timelines", []) if t]
    if not any(kind in "XO" for t in timelines for _, kind, _, _ in t):
        return None

    def last(kinds: str) -> float:
        return max((end for t in timelines for _, k, _, end in t if k in kinds), default=0.0)

    pipeline = last("FRB")
    exchanged = max(pipeline, last("X"))
    return {
        "pipeline_s": [predicted.get("pipeline_s"), pipeline],
        "exchange_s": [predicted.get("data_parallel_s"), exchanged - pipeline],
        "optimizer_s": [predicted.get("optimizer_s"), max(0.0, last("O") - exchanged)],
    }


def _exchange(predicted: dict, record: dict) -> dict | None:
    """The data-parallel exchange four ways (``None`` for runs before 2026-11-29, which
    did not time it on every step, and under ``dp = 1``): the model's, and the slowest
    rank's median inside the timed steps, run again alone with every stage at once
    (``together``) and one stage at a time (``by_stage``)."""
    alone = [a for a in record.get("exchange_alone_s_per_rank", []) if a]
    if not alone:
        return None
    return {
        "predicted_s": predicted.get("data_parallel_s"),
        "in_steps_s": max(record["exchange_s_per_rank"]),
        "together_s": max(a["together"] for a in alone),
        "by_stage_s": max(a["by_stage"] for a in alone),
    }


def markdown(summary: dict) -> str:
    """The comparison as a Markdown table and a summary line."""
    several = len(summary.get("calibrations", [])) > 1
    machine = "machine | " if several else ""
    lines = [
        f"| {machine}planner's place | plan | predicted s | measured s | error "
        "| peak MiB predicted / measured |",
        f"|{'---:|' if several else ''}---:|---|---:|---:|---:|---:|",
    ]
    for r in summary["rows"]:
        lines.append(
            f"| {str(r['calibration']) + ' | ' if several else ''}"
            f"{r['place']} | {r['plan']} | {r['predicted_s']:.2f} | {r['measured_s']:.2f}"
            f"{_runs(r)} | "
            f"{r['error']:+.0%} | {r['predicted_peak_bytes'] / 2**20:.0f} / "
            f"{r['measured_peak_bytes'] / 2**20:.0f} |"
        )
    split = [r for r in summary["rows"] if r.get("parts")]
    if split:
        lines += [
            "\n| plan | pipeline s predicted / measured | exchange s | optimizer s |",
            "|---|---:|---:|---:|",
        ]
        for r in split:
            cells = [
                f"{'-' if p is None else f'{p:.2f}'} / {m:.2f}" for p, m in r["parts"].values()
            ]
            lines.append(f"| {r['plan']} | {' | '.join(cells)} |")
    timed = [r for r in summary["rows"] if r.get("exchange")]
    if timed:
        lines += [
            "\n| plan | exchange s predicted | in the steps | alone, every stage at once "
            "| alone, a stage at a time |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in timed:
            cells = [f"{'-' if v is None else f'{v:.3f}'}" for v in r["exchange"].values()]
            lines.append(f"| {r['plan']} | {' | '.join(cells)} |")
    if several:
        lines.append("")
        for c in summary["calibrations"]:
            lines.append(
                f"machine {c['calibration']} ({c['plan']}, {c['plans']} plans): "
                f"{_choice(c)} the fastest measured there, {c['best_measured']}"
            )
    lines.append(
        f"\n{_choice(summary)} the fastest measured, {summary['best_measured']}; "
        "step time error median "
        f"{summary['median_abs_error']:.1%}, worst {summary['max_abs_error']:.1%}; Spearman "
        f"{summary['spearman']:.2f}; peak memory error median "
        f"{summary['median_abs_peak_error']:.1%}, worst {summary['max_abs_peak_error']:.1%}"
    )
    limit = summary.get("memory_limit")
    if limit:
        lines.append(
            f"memory limit {limit['bytes'] / 2**20:.0f} MiB: {len(limit['said_to_fit'])} plans "
            f"said to fit, {len(limit['said_not_to_fit'])} not; measured otherwise: "
            f"{', '.join(limit['wrong']) or 'none'}"
        )
    return "\n".join(lines)


def _choice(summary: dict) -> str:
    """The planner's choice and how it ran, in words, before "the fastest measured"."""
    gap = summary["chosen_over_best"]
    if gap is None:
        return "the planner's choice not among the runs;"
    return f"chosen {summary['chosen']}, measured {gap:+.1%} against"


def _runs(row: dict) -> str:
    """`` (median of N runs)`` for a plan measured more than once, else nothing."""
    return f" (median of {row['runs']} runs)" if row["runs"] > 1 else ""


def main() -> None:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", help="thinwire plan --json output")
    parser.add_argument("--results", nargs="+", default=[], help="the sweep's results.json")
    parser.add_argument(
        "--calibration",
        nargs="+",
        action="append",
        default=[],
        metavar="PLAN_JSON RESULTS_JSON",
        help="a sweep run on several machines: the plan JSON calibrated on one machine, then "
        "the results.json run there; once per machine, instead of --plan and --results",
    )
    parser.add_argument("--out", default="", help="write the comparison here (JSON)")
    parser.add_argument("--memory-limit", default="", help="check fits against it, e.g. 300MiB")
    args = parser.parse_args()
    limit = parse_bytes(args.memory_limit) if args.memory_limit else None
    if args.calibration and (args.plan or args.results):
        parser.error("pass either --plan and --results or --calibration, not both")
    if args.calibration:
        if any(len(group) < 2 for group in args.calibration):
            parser.error("--calibration takes a plan JSON and at least one results.json")
        groups = [(Path(g[0]), [Path(r) for r in g[1:]]) for g in args.calibration]
    elif args.plan and args.results:
        groups = [(Path(args.plan), [Path(r) for r in args.results])]
    else:
        parser.error("pass --plan PLAN.json --results RESULTS.json (or --calibration per machine)")
    summary = check_calibrations(groups, limit)
    print(markdown(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
