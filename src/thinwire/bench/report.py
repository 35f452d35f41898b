"""What a person reads after ``thinwire bench``: a table in the terminal and three plots.

``bench.png``: training loss against wall-clock time (what a user waits for), loss against
step (whether compression costs quality per step) and step throughput per method.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from rich.table import Table

from thinwire.bench.repeats import repeat_label, summarise_repeats


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def method_label(record: dict[str, Any]) -> str:
    """A record's method name, with its communicator when one other than ``auto`` was
    chosen (``powersgd (direct)``), so runs of one method over two communicators differ."""
    communicator = (record.get("options") or {}).get("communicator", "auto")
    return record["method"] if communicator == "auto" else f"{record['method']} ({communicator})"


def results_table(records: list[dict[str, Any]], title: str = "") -> Table:
    """One row per method: step time, efficiency, bytes, ratio, loss, metric.

    ``step s`` is the median over steps of the slowest rank's step; ``wall s`` the
    wall-clock time per step over the measured steps (until every rank finished). They
    agree for synchronous methods; for ``dga`` and ``ps-async``, whose ranks do not wait
    for each other every step, only ``wall s`` (and ``wall x``, dense's over it, and
    ``wall scaling``, ``local``'s over it) is their throughput. A repeated run
    (``--repeats``) has a row per method and repeat, named ``method #repeat``."""
    repeated = len({r.get("repeat", 1) for r in records}) > 1
    table = Table(title=title or _title(records))
    metric = next((r["eval_metric"] for r in records if r.get("eval_metric")), "eval")
    for column in (
        "method",
        "step s",
        "x dense",
        "wall s",
        "wall x",
        "scaling",
        "wall scaling",
        "MB sent",
        "ratio",
        "loss",
        metric,
        "predicted s",
    ):
        table.add_column(column, justify="left" if column == "method" else "right")
    for r in records:
        table.add_row(
            repeat_label(method_label(r), r.get("repeat", 1), repeated),
            f"{r['step_s_median']:.3f}",
            _fmt(r.get("throughput_vs_dense"), ".2f")
            + ("x" if r.get("throughput_vs_dense") else ""),
            _fmt(r.get("wall_step_s"), ".3f"),
            _fmt(r.get("wall_throughput_vs_dense"), ".2f")
            + ("x" if r.get("wall_throughput_vs_dense") else ""),
            _fmt(r.get("scaling_efficiency"), ".2f"),
            _fmt(r.get("wall_scaling_efficiency"), ".2f"),
            f"{r['bytes_sent_per_step'] / 1e6:.3f}",
            _fmt(r.get("compression_ratio"), ".1f"),
            f"{r['final_train_loss']:.4f}",
            _fmt(r.get("eval_value"), ".4g"),
            _fmt((r.get("predicted") or {}).get("step_s"), ".3f"),
        )
    return table


def repeats_table(summary: list[dict[str, Any]], repeats: int) -> Table:
    """One row per method of a repeated run (:func:`thinwire.bench.repeats.summarise_repeats`):
    the median over the repeats of its step time and ratios, with the smallest and largest
    value of each ratio, so the spread between runs is read beside the figure."""
    table = Table(title=f"over {repeats} repeats: median (smallest - largest)")
    for column in ("method", "runs", "step s", "scaling", "wall scaling", "x dense"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for entry in summary:
        table.add_row(
            method_label(entry),
            str(entry["repeats"]),
            _spread(entry.get("step_s_median"), ".3f"),
            _spread(entry.get("scaling_efficiency"), ".2f"),
            _spread(entry.get("wall_scaling_efficiency"), ".2f"),
            _spread(entry.get("throughput_vs_dense"), ".2f"),
        )
    return table


def _spread(figure: dict[str, Any] | None, spec: str) -> str:
    if not figure:
        return "-"
    median, low, high = (format(figure[k], spec) for k in ("median", "min", "max"))
    return f"{median} ({low} - {high})"


#: how much faster than ``local`` a method may measure before its timings are suspect
FASTER_THAN_LOCAL = 1.10


def timing_warnings(records: list[dict[str, Any]]) -> list[str]:
    """What makes this run's step times suspect: methods that measured more than 10 %
    faster than ``local``, which does the same compute with no exchange at all, so
    something else slowed ``local``'s steps (another process on the machine)."""
    faster = []
    for r in records:
        efficiency = max(
            r.get("scaling_efficiency") or 0.0, r.get("wall_scaling_efficiency") or 0.0
        )
        if r["method"] != "local" and efficiency > FASTER_THAN_LOCAL:
            repeat = f" (repeat {r['repeat']})" if r.get("repeat", 1) > 1 else ""
            faster.append(f"{method_label(r)} {efficiency:.2f}x{repeat}")
    if not faster:
        return []
    return [
        f"faster than local: {', '.join(faster)}. Nothing computes faster than local, which "
        "only skips the exchange, so something else on this machine slowed local's steps: "
        "this run's step times do not compare. Run it again with the machine otherwise idle."
    ]


def _title(records: list[dict[str, Any]]) -> str:
    if not records:
        return "thinwire bench"
    r = records[0]
    where = (
        f"{r['bandwidth']}, {r['latency']} latency"
        if r.get("network") == "emulated"
        else "loopback"
    )
    return (
        f"thinwire bench: {r['task']}, {r['workers']} workers, {where}, {r['steps']} steps "
        f"(timings from step {r['measured_from_step']})"
    )


def plot(records: list[dict[str, Any]], path: Path) -> Path:
    """Write loss-versus-time, loss-versus-step and throughput plots to ``path``. Of a
    repeated run, the losses are the first repeat's (every repeat trains the same steps)
    and each bar is the median throughput over the repeats, its whisker the range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = [r for r in records if r.get("repeat", 1) == 1]
    fig, (by_time, by_step, bars) = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in first:
        label = method_label(r)
        by_time.plot(r["time_history_s"], r["loss_history"], label=label)
        by_step.plot(range(1, len(r["loss_history"]) + 1), r["loss_history"], label=label)
    by_time.set(xlabel="wall-clock time (s)", ylabel="training loss", title="loss vs time")
    by_step.set(xlabel="step", ylabel="training loss", title="loss vs step")
    names = [method_label(r) for r in first]
    rates = [[1.0 / s for s in e["step_s_median"]["values"]] for e in summarise_repeats(records)]
    middle = [statistics.median(rate) for rate in rates]
    whiskers = [
        [m - min(rate) for m, rate in zip(middle, rates, strict=True)],
        [max(rate) - m for m, rate in zip(middle, rates, strict=True)],
    ]
    bars.bar(names, middle, yerr=whiskers, capsize=4, color="tab:blue")
    bars.set(ylabel="steps per second", title="throughput")
    bars.tick_params(axis="x", rotation=45)
    for axis in (by_time, by_step):
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    fig.suptitle(_title(records))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
