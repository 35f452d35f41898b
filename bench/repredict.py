"""Predict the steps of finished benchmark runs again, with the cost model as it is now.

    python bench/repredict.py docs/results/fashion-b80-fused-10mbit.json [...] [--write]

For each results file of ``thinwire bench`` on the emulated cluster, rebuilds the run's
configuration from its records, profiles the task's model in this process (as the bench
does after its runs) and prints, per method, the measured step, the new prediction and
its error beside the error the file recorded. ``--write`` stores the new predictions in
the file. The compute is calibrated to the file's own ``local`` step, as in the bench.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from thinwire.bench.methods import Method
from thinwire.bench.ratios import throughput_step_s
from thinwire.bench.repeats import repeat_label
from thinwire.bench.runner import BenchConfig, add_predictions


def config_of(records: list[dict[str, Any]]) -> BenchConfig:
    """The configuration a results file's records were run with."""
    stored = records[0]["config"]
    first = records[0].get("repeat", 1)
    return BenchConfig(
        task=stored["task"],
        methods=[Method(r["method"], r["options"]) for r in records if r.get("repeat", 1) == first],
        workers=stored["workers"],
        bandwidth=stored["bandwidth"],
        latency=stored["latency"],
        steps=stored["steps"],
        seed=stored.get("seed", 0),
        task_options=stored.get("task_options", {}),
        network=stored["network"],
        evaluate=False,
        bucket_cap_mb=stored.get("bucket_cap_mb"),
        fuse_rounds=stored.get("fuse_rounds", True),
        broadcast_buffers=stored.get("broadcast_buffers", True),
        repeats=max(r.get("repeat", 1) for r in records),
        compute=stored.get("compute", "real"),
        compute_speedup=stored.get("compute_speedup", 1.0),
    )


def repredict(path: Path, write: bool = False) -> list[tuple[str, float, float, float | None]]:
    """``(method, measured s, predicted s, error recorded before)`` for every predicted
    record of the results file at ``path`` (a method of a repeated run once per repeat,
    named ``method #repeat``); with ``write``, the file gets the new ones."""
    records = json.loads(path.read_text())
    if not records or "config" not in records[0]:
        raise ValueError(f"{path} is not a results file of thinwire bench")
    config = config_of(records)
    if config.network != "emulated":
        raise ValueError(f"{path}: a {config.network} run has no link to predict for")
    before = [(r.get("predicted") or {}).get("error") for r in records]
    add_predictions(config, records)
    if write:
        path.write_text(json.dumps(records, indent=2))
    return [
        (_name(r, config.repeats), throughput_step_s(r), r["predicted"]["step_s"], old)
        for r, old in zip(records, before, strict=True)
        if r.get("predicted")
    ]


def _name(record: dict[str, Any], repeats: int) -> str:
    return repeat_label(record["method"], record.get("repeat", 1), repeats > 1)


def main(argv: list[str] | None = None) -> int:
    """Print (and with ``--write`` store) the new predictions of each file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--write", action="store_true", help="store the new predictions")
    args = parser.parse_args(argv)
    for path in args.files:
        try:
            rows = repredict(path, args.write)
        except (OSError, ValueError, KeyError) as error:
            print(f"error: {path}: {error}", file=sys.stderr)
            return 1
        print(path)
        for method, measured, predicted, old in rows:
            was = "" if old is None else f"   recorded {old * 100:+.1f} %"
            error = (predicted / measured - 1) * 100
            print(
                f"  {method:14s} measured {measured:.3f} s  predicted {predicted:.3f} s "
                f"({error:+.1f} %){was}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
