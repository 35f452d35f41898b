"""Time to a quality: each method's training curve (from a real-compute quality run) laid on
its measured time per step (from a ``--compute sleep`` run on an emulated cluster).

    python bench/time_to_quality.py \
        --quality docs/results/text-small-quality-20000-dense.json ... \
        --timing 1mbit=runs/diloco-sleep-1mbit/results.json \
        --timing 100kbit=runs/diloco-sleep-100kbit/results.json \
        --out docs/results/diloco-time-to-quality

A method's quality at step t is its training loss averaged over the ``--window`` steps
up to t (every rank trains on its own batches; the bench records rank 0's loss). The
target is ``--baseline``'s (dense's) final averaged loss, loosened by ``--tolerance`` in
perplexity (``log(1 + tolerance)`` nats). Time to it: the first step whose average is at
or below it, times the method's time per step on each timed cluster (the median step of
a synchronous method, wall-clock time per step of one whose ranks wait for each other
only now and then: ``thinwire.bench.ratios.throughput_step_s``); with ``--compute-s``,
that compute plus what the method's step took beyond its own run's ``local`` (runs whose
measured compute differs then compare on the same compute). Methods pair up by
name; ``--label`` gives a quality file's records another (``diloco=diloco-h100``).
Writes ``OUT.json`` and ``OUT.png`` (quality against wall-clock time per cluster).

With ``--accuracy-points P`` (tasks whose quality is a held-out accuracy, evaluated once
at the end: the image task) the target is the baseline's final held-out accuracy less P
points instead; a method reaches it at its last step if its own final accuracy does, and
never otherwise (the only evaluation there is: a bound on the time, the same for every
method).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from thinwire.bench.ratios import throughput_step_s


def smoothed(losses: list[float], window: int) -> np.ndarray:
    """The mean of the last ``window`` losses at every step (fewer at the start)."""
    values = np.asarray(losses, dtype=float)
    sums = np.cumsum(values)
    out = np.empty_like(values)
    for t in range(len(values)):
        first = max(0, t - window + 1)
        out[t] = (sums[t] - (sums[first - 1] if first else 0.0)) / (t - first + 1)
    return out


def first_at_or_below(curve: np.ndarray, target: float) -> int | None:
    """The first step (1-based) at which ``curve`` is at or below ``target``."""
    hits = np.nonzero(curve <= target)[0]
    return int(hits[0]) + 1 if len(hits) else None


def load_records(paths: list[str]) -> list[dict[str, Any]]:
    """Every record of the bench result files ``paths``."""
    records = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        records.extend(data if isinstance(data, list) else data["records"])
    return records


def analyse(
    quality: list[dict[str, Any]],
    timing: dict[str, list[dict[str, Any]]],
    baseline: str,
    tolerance: float,
    window: int,
    compute_s: float | None = None,
    accuracy_points: float | None = None,
) -> dict[str, Any]:
    """Steps and seconds to the target for every quality record on every timed cluster
    (with ``compute_s``: each method's time per step is that compute plus what its step
    took beyond its own run's ``local``, so that runs whose measured compute differed
    compare on the same compute)."""
    by_name = {r["label"]: r for r in quality}
    if baseline not in by_name:
        raise SystemExit(f"no quality record named {baseline!r}: have {sorted(by_name)}")
    base = smoothed(by_name[baseline]["loss_history"], window)
    target = float(base[-1]) + math.log1p(tolerance)
    accuracy = None
    if accuracy_points is not None:
        if by_name[baseline].get("eval_value") is None:
            raise SystemExit(f"{baseline!r} has no held-out accuracy to aim at (eval_value)")
        accuracy = float(by_name[baseline]["eval_value"]) - accuracy_points / 100
    rows = []
    for record in quality:
        curve = smoothed(record["loss_history"], window)
        if accuracy is None:
            steps = first_at_or_below(curve, target)
        else:
            reached = (record.get("eval_value") or 0.0) >= accuracy
            steps = len(curve) if reached else None
        row: dict[str, Any] = {
            "label": record["label"],
            "method": record["method"],
            "options": record.get("options", {}),
            "steps": len(curve),
            "final_smoothed_loss": float(curve[-1]),
            "eval_metric": record.get("eval_metric"),
            "eval_value": record.get("eval_value"),
            "steps_to_target": steps,
            "clusters": {},
        }
        for cluster, records in timing.items():
            timed = next((r for r in records if r["method"] == record["label"]), None)
            timed = timed or next((r for r in records if r["method"] == record["method"]), None)
            if timed is None:
                continue
            measured_s = throughput_step_s(timed)
            local_s = timed.get("own_run_local_s")
            if compute_s is not None and local_s is not None:  # the same compute for all
                step_s = compute_s + max(0.0, measured_s - local_s)
            else:
                step_s = measured_s
            row["clusters"][cluster] = {
                "step_s": step_s,
                "measured_step_s": measured_s,
                "own_run_local_s": local_s,
                "timed_options": timed.get("options", {}),
                "seconds_to_target": steps * step_s if steps else None,
                "seconds_for_run": len(curve) * step_s,
            }
        rows.append(row)
    return {"target_loss": None if accuracy is not None else target,
            "target_accuracy": accuracy, "baseline": baseline, "tolerance": tolerance,
            "window": window, "compute_s": compute_s, "rows": rows}  # fmt: skip


def plot(result: dict[str, Any], quality: list[dict[str, Any]], window: int, out: Path) -> None:
    """Averaged training loss against wall-clock time, one panel per timed cluster."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clusters = sorted({c for row in result["rows"] for c in row["clusters"]})
    fig, axes = plt.subplots(1, max(1, len(clusters)), figsize=(6 * max(1, len(clusters)), 4))
    axes = np.atleast_1d(axes)
    curves = {r["label"]: smoothed(r["loss_history"], window) for r in quality}
    for axis, cluster in zip(axes, clusters, strict=False):
        for row in result["rows"]:
            timed = row["clusters"].get(cluster)
            if timed is None:
                continue
            curve = curves[row["label"]]
            hours = np.arange(1, len(curve) + 1) * timed["step_s"] / 3600
            label = row["label"]
            if result["target_accuracy"] is not None and row["eval_value"] is not None:
                label += f" (held-out {100 * row['eval_value']:.2f} %)"
            axis.plot(hours, curve, label=label)
        if result["target_loss"] is not None:
            axis.axhline(result["target_loss"], color="grey", linestyle=":", label="target")
        axis.set_xscale("log")
        axis.set_xlabel(f"hours on 4 emulated hosts at {cluster}")
        axis.set_ylabel(f"training loss (mean of {window} steps)")
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    """Read the runs, print the table, write the JSON and the plot."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quality", nargs="+", required=True, help="real-compute results")
    parser.add_argument(
        "--timing",
        action="append",
        default=[],
        help="NAME=results.json[,results.json...] of sleeping runs on one cluster",
    )
    parser.add_argument("--label", action="append", default=[], help="METHOD=LABEL")
    parser.add_argument("--baseline", default="dense")
    parser.add_argument("--tolerance", type=float, default=0.03, help="in perplexity")
    parser.add_argument("--window", type=int, default=200)
    parser.add_argument(
        "--compute-s",
        type=float,
        default=None,
        help="one compute time per step for every method: its step less its run's local",
    )
    parser.add_argument(
        "--accuracy-points",
        type=float,
        default=None,
        help="target: the baseline's final held-out accuracy less this many points",
    )
    parser.add_argument("--out", required=True, help="OUT.json and OUT.png are written")
    args = parser.parse_args()
    labels = dict(item.split("=", 1) for item in args.label)
    quality = load_records(args.quality)
    for record in quality:
        record["label"] = labels.get(record["method"], record["method"])
    timing: dict[str, list[dict[str, Any]]] = {}
    for item in args.timing:
        name, _, paths = item.partition("=")
        for path in paths.split(","):
            records = load_records([path])
            local = next((r for r in records if r["method"] == "local"), None)
            for record in records:  # each record keeps its own run's compute-only step
                record["own_run_local_s"] = throughput_step_s(local) if local else None
            timing.setdefault(name, []).extend(r for r in records if r["method"] != "local")
    result = analyse(
        quality,
        timing,
        args.baseline,
        args.tolerance,
        args.window,
        args.compute_s,
        args.accuracy_points,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, quality, args.window, out.with_suffix(".png"))
    if result["target_accuracy"] is not None:
        print(f"target: final held-out accuracy >= {100 * result['target_accuracy']:.2f} %")
    else:
        print(f"target: averaged training loss <= {result['target_loss']:.4f}")
    for row in result["rows"]:
        times = ", ".join(
            f"{c}: {t['step_s']:.3f} s/step, "
            + (f"{t['seconds_to_target'] / 3600:.2f} h" if t["seconds_to_target"] else "never")
            for c, t in row["clusters"].items()
        )
        held_out = (
            f"{row['eval_metric']} {row['eval_value']:.3f}" if row["eval_value"] is not None else ""
        )
        print(f"{row['label']:>14}  {held_out}  steps to target {row['steps_to_target']}  {times}")


if __name__ == "__main__":
    main()
