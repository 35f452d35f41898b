"""``thinwire demo``: a short real training on local processes under several compressors.

Trains the digits MLP with data parallelism on ``--workers`` gloo processes on this
machine, once per method, and prints a table: test accuracy, final loss, bytes each rank
sends per step, compression ratio and time. (The emulated slow-network benchmark is
``thinwire bench``.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from thinwire.launch import LocalPool
from thinwire.tasks.digits_training import DigitsRun, train_digits

DEFAULT_METHODS: dict[str, dict[str, Any]] = {
    "ddp": {},
    "none": {},
    "fp16": {},
    "dgc": {"density": 0.005, "warmup_steps": 60},
    "powersgd": {"rank": 4},
    "onebit": {},
    "terngrad": {},
}


def run_demo(
    workers: int = 4,
    steps: int = 300,
    methods: dict[str, dict[str, Any]] | None = None,
    out: Path | None = None,
    console: Console | None = None,
) -> list[dict[str, Any]]:
    """Train once per method on ``workers`` local processes; print and return the rows."""
    console = console or Console()
    methods = methods or DEFAULT_METHODS
    rows = []
    with LocalPool(workers) as pool, console.status("starting workers") as status:
        pool.run(_ready)  # process start-up and the first rendezvous stay out of the timings
        for name, options in methods.items():
            status.update(f"training digits with {name} on {workers} processes ({steps} steps)")
            began = time.perf_counter()
            results = pool.run(train_digits, DigitsRun(method=name, options=options, steps=steps))
            first = results[0]
            rows.append(
                {
                    "method": name,
                    "options": options,
                    "workers": workers,
                    "steps": steps,
                    "test_accuracy": first["test_accuracy"],
                    "final_train_loss": first["final_loss"],
                    "payload_bytes_per_step": first["payload_bytes_per_step"],
                    "compression_ratio": first["compression_ratio"],
                    "compress_s_per_step": first["compress_s_per_step"],
                    "wall_s": time.perf_counter() - began,
                    "ranks_agree": len({r["test_accuracy"] for r in results}) == 1,
                }
            )
    console.print(_table(rows))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "demo.json").write_text(json.dumps(rows, indent=2))
        console.print(f"results written to {out / 'demo.json'}")
    return rows


def _ready(rank: int, world_size: int) -> int:
    return rank


def _table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="thinwire demo: digits MLP, data parallel on local gloo processes")
    for column in (
        "method",
        "test acc",
        "train loss",
        "bytes/step/rank",
        "ratio",
        "compress ms/step",
        "wall s",
    ):
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in rows:
        payload = row["payload_bytes_per_step"]
        table.add_row(
            row["method"] + ("" if row["ranks_agree"] else " (ranks differ!)"),
            f"{row['test_accuracy']:.3f}",
            f"{row['final_train_loss']:.4f}",
            "DDP built-in" if payload != payload else f"{payload / 1e3:,.1f} kB",
            f"{row['compression_ratio']:.1f}x",
            f"{row['compress_s_per_step'] * 1e3:.2f}",
            f"{row['wall_s']:.1f}",
        )
    return table
