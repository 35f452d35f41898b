"""Quality table: each compressed run against dense, with issue 3's targets, as markdown.

    python bench/quality_table.py docs/results/fashion-quality-2000-*.json [--plot out.png]

Reads ``thinwire bench`` results files (one or more records each), takes the ``dense``
record as the reference and prints one row per record: the held-out metric, its distance
from dense (accuracy points; perplexity in percent) and whether it meets its target (DGC
within 1 point / 3 %, the other compressors within 2 points / 5 %). Rows come out in the
order of the files and records given. ``--plot`` draws their curves in one figure, as
``thinwire bench`` does for the methods of one run.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

#: (accuracy points, perplexity percent) a method may lose against dense
TARGETS = {"dgc": (1.0, 3.0)}
DEFAULT_TARGET = (2.0, 5.0)


def load_records(paths: list[Path]) -> list[dict[str, Any]]:
    """Every record of every results file, in order."""
    records: list[dict[str, Any]] = []
    for path in paths:
        data = json.loads(path.read_text())
        records.extend(data["records"] if isinstance(data, dict) else data)
    return records


def describe(record: dict[str, Any]) -> str:
    """The method and the options it ran with, e.g. ``dgc (warmup_steps=200)``; a wrapper
    method's compressor first, then the compressor's options, then the wrapper's:
    ``dga (compressor=dgc, warmup_steps=200, delay=1, lanes=1)``."""
    options = record.get("options") or {}
    pairs = sorted(options.items())
    if "compressor_options" in options:
        wrapper = sorted((k, v) for k, v in pairs if k not in ("compressor", "compressor_options"))
        pairs = [
            ("compressor", options["compressor"]),
            *sorted(options["compressor_options"].items()),
            *wrapper,
        ]
    shown = ", ".join(f"{k}={v}" for k, v in pairs)
    return f"{record['method']} ({shown})" if shown else record["method"]


def plot_labels(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records as the plot should name them: a method that appears more than once
    (``dgc`` with and without masking) is named with the options that tell its records
    apart (``dgc (masking=False)``), so no two curves or bars share a label."""
    counts = Counter(r["method"] for r in records)
    labelled = []
    for record in records:
        method = record["method"]
        if counts[method] == 1:
            labelled.append(record)
            continue
        siblings = [r.get("options", {}) for r in records if r["method"] == method]
        options = record.get("options", {})
        differing = {k: v for k, v in options.items() if any(o.get(k) != v for o in siblings)}
        label = describe({"method": method, "options": differing})
        labelled.append({**record, "method": label})
    return labelled


def compressor_of(record: dict[str, Any]) -> str:
    """The compressor a record's target is set by: the method itself, or the compressor a
    wrapper method (``dga``, ``ps-sync``, ``ps-async``, ...) sends with."""
    return (record.get("options") or {}).get("compressor") or record["method"]


def rows(records: list[dict[str, Any]]) -> list[str]:
    """Markdown table rows: method, metric, vs dense, target, final train loss."""
    dense = [r for r in records if r["method"] == "dense"]
    if len(dense) != 1:
        raise SystemExit(f"need exactly one dense record as the reference, got {len(dense)}")
    reference = dense[0]
    metric = reference["eval_metric"]
    out = []
    for record in records:
        value = record["eval_value"]
        if record is reference:
            shown, versus, verdict = _shown(metric, value), "", ""
        else:
            points, percent = TARGETS.get(compressor_of(record), DEFAULT_TARGET)
            if metric == "accuracy":
                delta = round(100 * (value - reference["eval_value"]), 2)  # judged as shown
                versus, met = f"{delta:+.2f}", delta >= -points
                goal = f"within {points:g}"
            else:
                delta = round(100 * (value / reference["eval_value"] - 1), 1)
                versus, met = f"{delta:+.1f} %", delta <= percent
                goal = f"within {percent:g} %"
            shown = _shown(metric, value)
            verdict = f"{goal}: {'met' if met else '**missed**'}"
        loss = record["final_train_loss"]
        out.append(f"| {describe(record)} | {shown} | {versus} | {verdict} | {loss:.3f} |")
    return out


def _shown(metric: str, value: float) -> str:
    return f"{100 * value:.2f} %" if metric == "accuracy" else f"{value:.2f}"


def main() -> None:
    """Print the table for the results files on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="thinwire bench results.json files")
    parser.add_argument("--plot", type=Path, help="also plot every record's curves here")
    args = parser.parse_args()
    records = load_records(args.results)
    if args.plot:
        from thinwire.bench.report import plot

        plot(plot_labels(records), args.plot)
    metric = next(r["eval_metric"] for r in records)
    print(f"| method | {metric} | vs dense | target | final train loss |")
    print("|---|---:|---:|---|---:|")
    print("\n".join(rows(records)))


if __name__ == "__main__":
    main()
