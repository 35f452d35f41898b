"""Operators thinwire runs per step, per compressor: the host's work that a GPU waits for.

    python bench/ops_per_step.py --out results/ops-per-step.json

On a GPU each PyTorch operator costs the host a few to tens of microseconds to launch,
whatever its size, so the number of operators a step's exchange runs is what its host
time scales with (``docs/host-cost.md``: on an H200 the exchange thread's math, not the
GPU's, is what is left of thinwire's cost). That count is the same on the CPU, so it can
be followed without a GPU. The image task's ResNet-18 (width 32, 62 parameter tensors)
with random gradients, a world of one (gloo), ``thinwire.DistributedOptimizer`` with
25 MB buckets, the verdicts read once per step as on a GPU; after ``--warmup`` steps, one
step's exchange runs on this thread under a dispatch mode that counts every ATen
operator. Reported per compressor: operators per step (views apart: they launch no
kernel), host reads (``_local_scalar_dense``: of a device value, a wait on a GPU; of a
host value, such as a random offset, none), the most frequent operators, and the
exchange's wall time here.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import thinwire
from host_cost import THINWIRE, VARIANTS, parse_variant  # bench/ is on the path here
from thinwire.launch import free_port
from thinwire.tasks.resnet import ResNet18


class CountOps(TorchDispatchMode):
    """Counts the ATen operators dispatched while it is active (on this thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        #: operators that only make a view (no kernel on a GPU)
        self.views = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.is_view:
            self.views += 1
        else:
            self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count(method: str, options: dict[str, Any], warmup: int) -> dict[str, Any]:
    """One steady-state step's operators for ``method``."""
    torch.manual_seed(0)
    model = ResNet18(width=32)
    opt = thinwire.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model, method, **options
    )
    opt.engine.defer_verdicts = True  # as on a GPU: the step's verdicts read once
    generator = torch.Generator().manual_seed(1)

    def fill() -> list[list[thinwire.comm.GradientItem]]:
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator) * 1e-2
        return [
            [thinwire.comm.GradientItem(name, p.grad, p) for name, p in bucket]
            for bucket in opt.buckets
        ]

    for _ in range(warmup):
        opt._exchange(fill())
    items = fill()
    counter = CountOps()
    started = time.perf_counter()
    with counter:
        opt._exchange(items)
    wall = time.perf_counter() - started
    return {
        "method": method,
        "options": options,
        "buckets": len(opt.buckets),
        "ops": sum(counter.counts.values()),
        "views": counter.views,
        "host_reads": counter.counts["_local_scalar_dense"],
        "top": counter.counts.most_common(10),
        "exchange_ms_here": wall * 1e3,
    }


def main(argv: list[str] | None = None) -> None:
    """Count, print, write."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(THINWIRE))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=METHOD:NAME=VALUE,...",
        help="one more row with other options, e.g. dgc-threshold=dgc:density=0.01,"
        "selection=threshold (DGC's GPU selection, here on the CPU)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    labels = args.methods.split(",")
    for text in args.variant:
        label, method, options = parse_variant(text)
        VARIANTS[label] = (method, options)
        labels.append(label)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    rows = []
    try:
        for method in labels:
            name, options = VARIANTS[method] if method in VARIANTS else (method, THINWIRE[method])
            row = count(name, options, args.warmup)
            row["label"] = method
            rows.append(row)
            top = ", ".join(f"{op} {n}" for op, n in row["top"][:5])
            print(
                f"{method:<14} {row['ops']:5d} ops, {row['views']:4d} views, "
                f"{row['host_reads']:3d} host reads  ({top})",
                flush=True,
            )
    finally:
        dist.destroy_process_group()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "command": "python bench/ops_per_step.py " + " ".join(argv or sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "rows": rows,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
