"""thinwire's CUDA paths on a GPU: DDP with the hook on CUDA tensors, bf16, and compute time.

    python bench/gpu_check.py --out results/gpu

Needs one CUDA device (the suite never does: this is a check to run where a GPU is lent).
Two parts, written to ``DIR/gpu_check.json``:

1. **Paths.** The image task's ResNet-18 (base width 32, batch 32 of random 28x28 images,
   fixed seeds) trains a few SGD steps under DDP with thinwire's hook for every compressor,
   with fp32 and with bf16 parameters, in these process layouts:

   * ``nccl x1``: NCCL, one rank on the GPU (collectives of one, but NCCL's code paths:
     no CPU tensor may reach a collective);
   * ``gloo x2 cuda``: gloo, two ranks sharing the GPU (gloo carries CUDA tensors);
   * ``gloo x2 cpu``: the same two ranks on the CPU, fp32 only: the reference.

   Each run records the losses, whether every parameter stayed finite, whether the ranks
   hold the same parameters (bit for bit; delayed averaging: within 8 ulps), the median
   step time, and (compressor ``none``) the largest difference from plain DDP. For each
   compressor, the CUDA run's loss after the first exchange and its last loss are
   compared with the CPU reference's (TF32 off and deterministic kernels, so both compute
   in fp32 and a rerun gives the same bits); the stochastic compressors (``terngrad``,
   ``qsgd``) draw their random numbers on the GPU there, so they differ from the start.
   ``optimizer:powersgd`` and ``dga:powersgd`` run the two front ends without DDP
   (``DistributedOptimizer``; ``DelayedAveraging`` with delay 1, flushed at the end).
   ``nan:NAME`` rows: a NaN in one gradient on the first step must fail the step with
   thinwire's ``NonFiniteGradientError``, not train on garbage.
2. **Compute.** The same model's training step alone (forward, backward, SGD step; no
   DDP) at batch 32 and 80, fp32 and bf16 autocast, as the median of timed steps; and the
   time a dense ring all-reduce of its gradient takes over 4 workers on a 1 Gbit/s link,
   for the compute-to-bandwidth ratio a GPU sees there.

Compressor speed on the GPU: ``python bench/compressors.py --device cuda``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel

import thinwire
from thinwire.launch import free_port
from thinwire.tasks.resnet import ResNet18

#: compressors and the options they run with here (a small model: DGC keeps 1%)
METHODS: dict[str, dict[str, Any]] = {
    "ddp": {},  # PyTorch's own all-reduce, no hook: the reference for "none"
    "none": {},
    "fp16": {},
    "bf16": {},
    "powersgd": {"rank": 2},
    "powersgd-oneround": {"rank": 2},
    "dgc": {"density": 0.01},
    "topk": {"density": 0.01},
    "randomk": {"density": 0.01},
    "onebit": {},
    "signsgd": {},
    "terngrad": {},
    "qsgd": {},
    # the two front ends without DDP, with PowerSGD (rank 2): "wrapper:compressor"
    "optimizer:powersgd": {"rank": 2},  # thinwire.DistributedOptimizer
    "dga:powersgd": {"rank": 2},  # thinwire.DelayedAveraging, delay 1 (flushed at the end)
}
#: compressors whose refusal of a NaN gradient is checked (the hook, first step)
NAN_CHECKED = ("none", "powersgd", "dgc", "onebit")
LAYOUTS = [
    ("nccl", 1, "cuda", ("float32", "bfloat16")),
    ("gloo", 2, "cuda", ("float32", "bfloat16")),
    ("gloo", 2, "cpu", ("float32",)),
]
BATCH, WIDTH, STEPS, TIMED = 32, 32, 10, 6
LINK_BITS_PER_S, WORKERS = 1e9, 4


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so host clocks time it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_once(
    method: str, dtype: torch.dtype, device: torch.device, rank: int, world: int
) -> dict[str, Any]:
    """A few DDP steps of the ResNet under ``method``; what they did, for the report."""
    torch.manual_seed(0)
    model = ResNet18(width=WIDTH).to(device=device, dtype=dtype)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapper, _, compressor = method.rpartition(":")
    optimizer: Any = sgd
    forward: torch.nn.Module = model
    if wrapper == "optimizer":
        optimizer = thinwire.DistributedOptimizer(sgd, model, compressor, **METHODS[method])
    elif wrapper == "dga":
        optimizer = thinwire.DelayedAveraging(sgd, model, compressor, **METHODS[method])
    else:
        device_ids = [device.index] if device.type == "cuda" else None
        forward = DistributedDataParallel(model, device_ids=device_ids)
        if method != "ddp":
            thinwire.register(forward, method, **METHODS[method])
    generator = torch.Generator().manual_seed(1 + rank)
    images = torch.randn(BATCH, 1, 28, 28, generator=generator).to(device=device, dtype=dtype)
    labels = torch.randint(0, 10, (BATCH,), generator=generator).to(device)
    losses, times = [], []
    for _ in range(STEPS):
        sync(device)
        started = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(forward(images).float(), labels)
        loss.backward()
        optimizer.step()
        sync(device)
        times.append(time.perf_counter() - started)
        losses.append(float(loss.detach()))
    if wrapper == "dga":
        optimizer.flush()
    mine = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    highest, lowest = mine.clone(), mine.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    flat = mine.cpu()
    return {
        "losses": losses,
        "finite": bool(torch.isfinite(flat).all()),
        # synchronous methods: the same bits on every rank; delayed averaging: the same
        # weights up to rounding (each rank applies its own gradient, then the correction)
        "rank_spread": float((highest - lowest).abs().max()),
        "step_ms_median": statistics.median(times[-TIMED:]) * 1e3,
        "params": flat,
    }


def nan_is_refused(method: str, device: torch.device) -> dict[str, Any]:
    """One DDP step whose gradients hold a NaN: whether the hook refuses it by name."""
    torch.manual_seed(0)
    model = ResNet18(width=WIDTH).to(device)
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    thinwire.register(ddp, method, **METHODS[method])
    images = torch.randn(BATCH, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (BATCH,), device=device)
    loss = F.cross_entropy(ddp(images), labels) * torch.tensor(math.nan, device=device)
    try:
        loss.backward()
    except RuntimeError as error:
        refused = "NonFiniteGradientError" in str(error)
        return {"ok": refused, "error": str(error)[:300]}
    return {"ok": False, "error": "the NaN step was not refused"}


def layout_worker(
    rank: int,
    world: int,
    backend: str,
    device_kind: str,
    dtypes: tuple[str, ...],
    port: int,
    out: str,
) -> None:
    """One rank of one layout: every method in every dtype; rank 0 writes the records."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUBLAS_WORKSPACE_CONFIG=":4096:8"
    )
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    records = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        reference = None
        for method in METHODS:
            record: dict[str, Any] = {"method": method, "dtype": dtype_name}
            try:
                result = train_once(method, dtype, device, rank, world)
                params = result.pop("params")
                if method == "ddp":
                    reference = params
                elif method == "none" and reference is not None:
                    record["max_diff_from_ddp"] = float((params - reference).abs().max())
                # delayed averaging: each rank's weights are rounded on their own path,
                # so allow a few units in the last place at the largest weight
                largest = float(params.abs().max())
                ulps = 8 * torch.finfo(dtype).eps * largest
                allowed = ulps if method.startswith("dga:") else 0.0
                ok = result["finite"] and result["rank_spread"] <= allowed
                record.update(result, ok=ok)
            except Exception as error:  # the report says what failed and goes on
                record.update(ok=False, error=f"{type(error).__name__}: {error}"[:600])
                record["traceback"] = traceback.format_exc()[-1500:]
            records.append(record)
    if device.type == "cuda":
        for method in NAN_CHECKED:
            record = {"method": f"nan:{method}", "dtype": "float32"}
            try:
                record.update(nan_is_refused(method, device))
            except Exception as error:  # the report says what failed and goes on
                record.update(ok=False, error=f"{type(error).__name__}: {error}"[:600])
            records.append(record)
    if rank == 0:
        Path(out).write_text(json.dumps(records))
    dist.destroy_process_group()


def run_layout(
    backend: str, world: int, device_kind: str, dtypes: tuple[str, ...], limit_s: float
) -> dict[str, Any]:
    """Spawn one layout's ranks; its records, or why there are none."""
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "records.json")
        context = mp.spawn(
            layout_worker,
            args=(world, backend, device_kind, dtypes, free_port(), out),
            nprocs=world,
            join=False,
        )
        deadline = time.monotonic() + limit_s
        error = None
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    error = f"no result within {limit_s:.0f} s"
                    break
        except Exception as failure:  # a rank died: keep its message
            error = f"{type(failure).__name__}: {failure}"[-1500:]
        for process in context.processes:
            if process.is_alive():
                process.kill()
        records = json.loads(Path(out).read_text()) if Path(out).exists() else []
    return {"records": records, "error": error}


def compare_with_cpu(layouts: dict[str, dict[str, Any]], step: int) -> dict[str, float]:
    """|loss on CUDA - loss on CPU| / loss on CPU at ``step`` (-1: the last), per method
    (fp32, gloo x2)."""
    cpu = {r["method"]: r for r in layouts["gloo x2 cpu"]["records"] if r.get("ok")}
    cuda = {
        r["method"]: r
        for r in layouts["gloo x2 cuda"]["records"]
        if r.get("ok") and r["dtype"] == "float32"
    }
    return {
        m: abs(cuda[m]["losses"][step] - cpu[m]["losses"][step]) / abs(cpu[m]["losses"][step])
        for m in cpu
        if m in cuda
    }


def compute_times(device: torch.device) -> list[dict[str, Any]]:
    """The model's training step alone on the GPU, and a dense all-reduce's time over
    ``WORKERS`` workers on a ``LINK_BITS_PER_S`` link beside it."""
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    rows = []
    for batch in (32, 80):
        for precision in ("fp32", "bf16 autocast"):
            torch.manual_seed(0)
            model = ResNet18(width=WIDTH).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            images = torch.randn(batch, 1, 28, 28, device=device)
            labels = torch.randint(0, 10, (batch,), device=device)
            times = []
            for step in range(40):
                sync(device)
                started = time.perf_counter()
                with torch.autocast("cuda", torch.bfloat16, enabled=precision != "fp32"):
                    loss = F.cross_entropy(model(images), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                sync(device)
                if step >= 10:
                    times.append(time.perf_counter() - started)
            grad_bytes = sum(p.numel() * 4 for p in model.parameters())
            ring_s = 2 * (WORKERS - 1) / WORKERS * grad_bytes * 8 / LINK_BITS_PER_S
            step_s = statistics.median(times)
            rows.append(
                {
                    "batch": batch,
                    "precision": precision,
                    "step_ms_median": step_s * 1e3,
                    "gradient_bytes": grad_bytes,
                    "dense_allreduce_ms_at_1gbit_4_workers": ring_s * 1e3,
                    "allreduce_over_compute": ring_s / step_s,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run both parts, print the tables, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/gpu"))
    parser.add_argument("--limit-s", type=float, default=240, help="per layout")
    parser.add_argument(
        "--layouts",
        default="all",
        help="comma-separated subset of: " + ", ".join(f"{b}x{w}-{d}" for b, w, d, _ in LAYOUTS),
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this check needs a CUDA device; torch.cuda.is_available() is False here")
    console = Console(width=120)
    device = torch.device("cuda", 0)
    environment = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "gpu": torch.cuda.get_device_name(device),
        "cpu": platform.processor() or platform.machine(),
    }
    console.print(environment)

    known = {f"{b}x{w}-{d}" for b, w, d, _ in LAYOUTS}
    chosen = known if args.layouts == "all" else set(args.layouts.split(","))
    if chosen - known:
        parser.error(f"unknown layouts {sorted(chosen - known)}; choose from {sorted(known)}")
    layouts: dict[str, dict[str, Any]] = {}
    for backend, world, device_kind, dtypes in LAYOUTS:
        if f"{backend}x{world}-{device_kind}" not in chosen:
            continue
        name = f"{backend} x{world} {device_kind}"
        started = time.perf_counter()
        layouts[name] = run_layout(backend, world, device_kind, dtypes, args.limit_s)
        layouts[name]["wall_s"] = time.perf_counter() - started
        console.print(f"{name}: {layouts[name]['wall_s']:.0f} s, error: {layouts[name]['error']}")
    compared = {"gloo x2 cpu", "gloo x2 cuda"} <= set(layouts)
    first_diff = compare_with_cpu(layouts, 1) if compared else {}
    cpu_diff = compare_with_cpu(layouts, -1) if compared else {}

    gpu = environment["gpu"]
    table = Table(title=f"DDP + thinwire hook, ResNet-18 width 32, batch 32, one {gpu}")
    for column in ("layout", "method", "dtype", "ok", "loss first -> last", "step ms", "note"):
        table.add_column(column)
    for name, layout in layouts.items():
        for r in layout["records"]:
            note = r.get("error", "")[:60]
            if "max_diff_from_ddp" in r:
                note = f"max |none - ddp| {r['max_diff_from_ddp']:.1e}"
            if r["method"].startswith("dga:") and "rank_spread" in r:
                note = f"ranks within {r['rank_spread']:.1e}"
            if name == "gloo x2 cuda" and r["dtype"] == "float32" and r["method"] in cpu_diff:
                note += f" vs cpu {first_diff[r['method']]:.0e}, {cpu_diff[r['method']]:.0e}"
            losses = r.get("losses")
            table.add_row(
                name,
                r["method"],
                r["dtype"],
                "[green]yes[/]" if r["ok"] else "[red]no[/]",
                f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "",
                f"{r['step_ms_median']:.1f}" if "step_ms_median" in r else "",
                note,
            )
    console.print(table)

    compute = compute_times(device)
    compute_table = Table(title="training step alone on the GPU vs a dense all-reduce at 1 Gbit/s")
    for column in ("batch", "precision", "step ms", "all-reduce ms (4 workers)", "ratio"):
        compute_table.add_column(column, justify="right")
    for row in compute:
        compute_table.add_row(
            str(row["batch"]),
            row["precision"],
            f"{row['step_ms_median']:.2f}",
            f"{row['dense_allreduce_ms_at_1gbit_4_workers']:.0f}",
            f"{row['allreduce_over_compute']:.0f}x",
        )
    console.print(compute_table)

    report = {
        "command": "python bench/gpu_check.py",
        "environment": environment,
        "layouts": layouts,
        "loss_rel_diff_cuda_vs_cpu_after_first_step": first_diff,
        "loss_rel_diff_cuda_vs_cpu_last": cpu_diff,
        "compute": compute,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    console.print(f"wrote {args.out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
