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
host value, such as a random offset, none), the most frequent operators, and the median
wall time of ``--timed`` more steps' exchanges on this thread alone (``--device cuda``:
NCCL on a GPU), and that time per operator.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import statistics
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


def count(
    method: str,
    options: dict[str, Any],
    warmup: int,
    device: torch.device,
    timed: int,
    profile: bool = False,
) -> dict[str, Any]:
    """One steady-state step's operators for ``method``, and the median wall time of
    ``timed`` more steps' exchanges run on this thread (no other thread competing)."""
    torch.manual_seed(0)
    model = ResNet18(width=32).to(device)
    opt = thinwire.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model, method, **options
    )
    opt.engine.defer_verdicts = os.environ.get("LAZY", "1") == "1"  # as on a GPU: read once
    generator = torch.Generator().manual_seed(1)
    shapes = [p.shape for p in model.parameters()]
    grads = [
        [(torch.randn(s, generator=generator) * 1e-2).to(device) for s in shapes] for _ in range(2)
    ]

    def fill(step: int) -> list[list[thinwire.comm.GradientItem]]:
        for p, grad in zip(model.parameters(), grads[step % 2], strict=True):
            p.grad = grad.clone()
        return [
            [thinwire.comm.GradientItem(name, p.grad, p) for name, p in bucket]
            for bucket in opt.buckets
        ]

    for step in range(warmup):
        opt._exchange(fill(step))
    items = fill(warmup)
    counter = CountOps()
    with counter:
        opt._exchange(items)
    times = []
    for step in range(timed):
        items = fill(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        opt._exchange(items)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    profiled = profile_exchange(opt, fill, device) if profile else None
    ops = sum(counter.counts.values())
    median_ms = statistics.median(times) * 1e3 if times else float("nan")
    return {
        "method": method,
        "options": options,
        "buckets": len(opt.buckets),
        "ops": ops,
        "views": counter.views,
        "host_reads": counter.counts["_local_scalar_dense"],
        "top": counter.counts.most_common(10),
        "all": dict(counter.counts),
        "exchange_ms": median_ms,
        "us_per_op": median_ms * 1e3 / ops if ops else None,
        "profile": profiled,
    }


def profile_exchange(opt: Any, fill: Any, device: torch.device, steps: int = 5) -> list[dict]:
    """The operators of ``steps`` exchanges under ``torch.profiler``: per operator, calls
    per step and the host's and the device's own time per step (us), most host time first."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    batches = [fill(step) for step in range(steps)]  # the gradients' copies not profiled
    with torch.profiler.profile(activities=activities) as profiler:
        for items in batches:
            opt._exchange(items)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    rows = []
    for event in profiler.key_averages():
        if not event.key.startswith(("aten::", "c10d::", "cuda", "triton", "nccl")):
            continue
        rows.append(
            {
                "op": event.key,
                "calls": event.count / steps,
                "host_us": event.self_cpu_time_total / steps,
                "device_us": getattr(event, "self_device_time_total", 0.0) / steps,
            }
        )
    return sorted(rows, key=lambda row: -row["host_us"])[:25]


def main(argv: list[str] | None = None) -> None:
    """Count, print, write."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(THINWIRE))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timed", type=int, default=10, help="exchanges timed per method")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=METHOD:NAME=VALUE,...",
        help="one more row with other options, e.g. dgc-threshold=dgc:density=0.01,"
        "selection=threshold (DGC's GPU selection, here on the CPU)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="also each operator's host and device time"
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
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    rows = []
    try:
        for method in labels:
            name, options = VARIANTS[method] if method in VARIANTS else (method, THINWIRE[method])
            row = count(name, options, args.warmup, device, args.timed, args.profile)
            row["label"] = method
            rows.append(row)
            top = ", ".join(f"{op} {n}" for op, n in row["top"][:5])
            print(
                f"{method:<14} {row['ops']:5d} ops, {row['views']:4d} views, "
                f"{row['host_reads']:3d} host reads, {row['exchange_ms']:.2f} ms "
                f"({row['us_per_op']:.0f} us an operator)  ({top})",
                flush=True,
            )
            for line in row["profile"] or []:
                print(
                    f"    {line['op']:<40} {line['calls']:6.1f} calls {line['host_us']:8.1f} us "
                    f"host {line['device_us']:8.1f} us device",
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
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "rows": rows,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
