"""Compressor benchmark: one exchange round per compressor on one large gradient, 1 thread.

    python bench/compressors.py --numel 25000000 --out results/compressors.json

For a ``numel``-element fp32 gradient (5000 x 5000 by default) it times, as the median of
``--repeats`` runs after one warm-up run, every compressor's exchange round in a world of
one process (``run_locally``: encode, the collective's answer, decode), the same round with
the compressor's error-feedback memory around it (compensate + exchange + update), and the
bytes this rank puts on the wire. Next to them, the references:

* exact ``torch.topk`` of |g| at density 0.001, against DGC's sampled-threshold selection;
* PyTorch's ``powerSGD_hook`` math on the same matrix at the same rank (its steps, redone
  here for a world of one: error add, copy, orthogonalize Q, bmm, orthogonalize P, bmm,
  decompress into the gradient, error = copy - decompressed).

Machines are noisy: read the ratios, which come from one run side by side.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor

from thinwire.compress.base import Compressor, Slot, run_locally
from thinwire.compress.dgc import DGC
from thinwire.compress.registry import compressor as build_compressor

#: every compressor module, in the order of the table (some may not exist yet)
MODULES = [
    "none",
    "fp16",
    "bf16",
    "topk",
    "randomk",
    "dgc",
    "powersgd",
    "onebit",
    "signsgd",
    "terngrad",
    "qsgd",
]
DENSITY = 0.001


def sync() -> None:
    """Wait for queued GPU work (nothing to wait for on the CPU), so host clocks time it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(run: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``run`` in milliseconds, after one untimed warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def options_for(name: str, rank: int) -> dict[str, Any]:
    """The options each compressor is benchmarked with (defaults for the others)."""
    if name in ("topk", "randomk", "dgc"):
        return {"density": DENSITY}
    if name == "powersgd":
        return {"rank": rank}
    return {}


def bench_compressor(
    name: str, grad: Tensor, rank: int, repeats: int
) -> tuple[dict[str, Any], Compressor]:
    """Exchange-only and with-memory round times, wire bytes and ratio for one compressor."""
    comp = build_compressor(name, **options_for(name, rank))
    memory = comp.make_memory()
    compressed = comp.compresses(grad)
    step = [0]

    def exchange_only() -> None:
        step[0] += 1
        run_locally(comp.exchange(grad, Slot("w", step[0], 1)))

    def with_memory() -> None:
        step[0] += 1
        slot = Slot("w", step[0], 1)
        corrected = memory.compensate(grad, slot)
        result = run_locally(comp.exchange(corrected, slot))
        memory.update(corrected, result, slot, compressed=True)

    wire: list[int] = []
    run_locally(comp.exchange(grad, Slot("w", 0, 1)), wire)
    result = {
        "options": options_for(name, rank),
        "compresses": compressed,
        "exchange_ms": median_ms(exchange_only, repeats),
        "round_ms": median_ms(with_memory, repeats),
        "wire_bytes": sum(wire),
        "collectives": len(wire),
        "compression_ratio": grad.numel() * 4 / sum(wire),
    }
    return result, comp


def bench_dgc_selection(grad: Tensor, repeats: int) -> dict[str, Any]:
    """DGC's sampled selection against exact torch.topk at density 0.001 on |g|."""
    flat = grad.reshape(-1)
    k = max(1, round(flat.numel() * DENSITY))
    dgc = DGC(density=DENSITY)
    counts: list[int] = []
    tries: list[int] = []

    def sampled() -> None:
        dgc.select(flat, k, Slot("w", 0, 1))
        counts.append(dgc.last_candidates)
        tries.append(dgc.last_tries)

    exact = torch.topk(flat.abs(), k, sorted=False).indices
    same = set(dgc.select(flat, k, Slot("w", 0, 1)).tolist()) == set(exact.tolist())
    topk_ms = median_ms(lambda: torch.topk(flat.abs(), k, sorted=False), repeats)
    select_ms = median_ms(sampled, max(repeats, 9))
    return {
        "k": k,
        "torch_topk_ms": topk_ms,
        "dgc_select_ms": select_ms,
        "speedup": topk_ms / select_ms,
        "candidates_over_k_median": statistics.median(counts) / k,
        "candidates_over_k_max": max(counts) / k,
        "threshold_tries": tries,
        "same_set_as_torch_topk": same,
    }


# -- PyTorch's powerSGD_hook, its per-step math for one tensor in a world of one ----------


def hook_orthogonalize(matrices: Tensor, eps: float) -> None:
    """The hook's ``_orthogonalize`` on a (batch, rows, rank) tensor: Gram-Schmidt over the
    columns for rank <= 2, else ``torch.linalg.qr`` written back in place."""
    batch, _, rank = matrices.shape
    if rank > 2:
        r_factor = torch.empty(batch, rank, rank, dtype=matrices.dtype, device=matrices.device)
        torch.linalg.qr(matrices, out=(matrices, r_factor))
        return
    for i in range(rank):
        column = matrices[:, :, i : i + 1]
        column /= torch.norm(column, dim=1, keepdim=True) + eps
        if i + 1 < rank:
            others = matrices[:, :, i + 1 :]
            others -= torch.sum(column * others, dim=1, keepdim=True) * column


class HookMath:
    """State and one step of ``powerSGD_hook`` (use_error_feedback, warm_start) for one
    gradient tensor: ``step(bucket)`` turns the bucket into the decompressed mean."""

    def __init__(
        self, n: int, m: int, rank: int, eps: float = 1e-8, device: torch.device | str = "cpu"
    ) -> None:
        self.n, self.m, self.rank, self.eps = n, m, rank, eps
        self.error: Tensor | None = None
        self.p = torch.empty(1, n, rank, device=device)
        self.q = torch.randn(1, m, rank, generator=torch.Generator().manual_seed(0)).to(device)
        hook_orthogonalize(self.q, eps)

    def step(self, bucket: Tensor) -> Tensor:
        """Compress and decompress ``bucket`` (flat, overwritten) as the hook does."""
        if self.error is not None:
            bucket.add_(self.error)
        else:
            self.error = torch.zeros_like(bucket)
        copy = bucket.detach().clone()
        matrix = bucket.view(1, self.n, self.m)
        hook_orthogonalize(self.q, self.eps)  # warm start: last step's Q, orthogonalized
        torch.bmm(matrix, self.q, out=self.p)
        # all-reduce P (world of one: nothing to add)
        hook_orthogonalize(self.p, self.eps)
        torch.bmm(matrix.transpose(1, 2), self.p, out=self.q)
        self.q.div_(1)  # all-reduce Q, divide by the world size
        torch.bmm(self.p, self.q.transpose(1, 2), out=matrix)
        self.error = copy - bucket
        return bucket


def bench_powersgd_vs_hook(grad: Tensor, rank: int, repeats: int) -> dict[str, Any]:
    """thinwire's PowerSGD round (memory included) against the hook math, same matrix."""
    n, m = grad.shape
    hook = HookMath(n, m, rank, device=grad.device)
    bucket = torch.empty(grad.numel(), device=grad.device)
    hook_times = []
    bucket.copy_(grad.reshape(-1))
    hook.step(bucket)  # warm-up: allocates the error
    for _ in range(repeats):
        bucket.copy_(grad.reshape(-1))  # DDP fills the bucket: not timed
        sync()
        started = time.perf_counter()
        hook.step(bucket)
        sync()
        hook_times.append(time.perf_counter() - started)
    comp = build_compressor("powersgd", rank=rank)
    memory = comp.make_memory()

    def thinwire_round(step: int) -> None:
        slot = Slot("w", step, 1)
        corrected = memory.compensate(grad, slot)
        result = run_locally(comp.exchange(corrected, slot))
        memory.update(corrected, result, slot, compressed=True)

    thinwire_round(0)
    times = []
    for step in range(1, repeats + 1):
        sync()
        started = time.perf_counter()
        thinwire_round(step)
        sync()
        times.append(time.perf_counter() - started)
    hook_ms = statistics.median(hook_times) * 1e3
    ours_ms = statistics.median(times) * 1e3
    assert hook.error is not None
    grad_norm = float(grad.norm())
    return {
        "rank": rank,
        "hook_ms": hook_ms,
        "thinwire_ms": ours_ms,
        "speedup": hook_ms / ours_ms,
        # same math, so after the same steps the residuals should be about equally large
        "hook_residual_over_grad": float(hook.error.norm()) / grad_norm,
        "thinwire_residual_over_grad": float(memory.residuals["w"].norm()) / grad_norm,  # type: ignore[attr-defined]
        "products_ms": profile_products(grad, rank, repeats),
    }


def profile_products(grad: Tensor, rank: int, repeats: int) -> dict[str, float]:
    """The products of one PowerSGD round in both layouts, to show where the time goes."""
    matrix = grad.reshape(grad.shape[0], -1)
    n, m = matrix.shape
    q, p = torch.randn(m, rank, device=grad.device), torch.randn(n, rank, device=grad.device)
    qt, pt = q.T.contiguous(), p.T.contiguous()
    out = torch.empty_like(matrix)
    return {
        "M@Q (column layout)": median_ms(lambda: matrix @ q, repeats),
        "Qt@M.T (row layout)": median_ms(lambda: qt @ matrix.T, repeats),
        "M.T@P (column layout)": median_ms(lambda: matrix.T @ p, repeats),
        "Pt@M (row layout)": median_ms(lambda: pt @ matrix, repeats),
        "P@Q.T fresh tensor": median_ms(lambda: p @ q.T, repeats),
        "P@Q.T into a buffer": median_ms(lambda: torch.mm(pt.T, qt, out=out), repeats),
        "M - local fresh": median_ms(lambda: matrix - out, repeats),
        "M -= local in place": median_ms(lambda: out.sub_(matrix), repeats),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=1, help="PowerSGD rank (both sides)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda to time on the GPU")
    parser.add_argument("--out", type=Path, default=Path("results/compressors.json"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device (torch.cuda.is_available())")
    torch.set_num_threads(args.threads)
    console = Console(width=110)

    rows = max(1, math.isqrt(args.numel))
    shape = (rows, args.numel // rows)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    console.print(f"gradient {shape[0]} x {shape[1]} fp32 on {where}, {args.threads} thread(s)")

    skipped: dict[str, str] = {}
    for module in MODULES:
        try:
            importlib.import_module(f"thinwire.compress.{module}")
        except ImportError as error:
            skipped[module] = f"does not import yet: {error}"
            console.print(f"[yellow]skipping {module}: {skipped[module]}[/]")

    results: dict[str, dict[str, Any]] = {}
    for name in MODULES:
        if name in skipped:
            continue
        try:
            results[name], _ = bench_compressor(name, grad, args.rank, args.repeats)
        except Exception as error:  # another engineer's module may be half-way done
            skipped[name] = f"failed: {type(error).__name__}: {error}"
            console.print(f"[yellow]skipping {name}: {skipped[name]}[/]")
            continue
        console.print(f"  {name}: {results[name]['exchange_ms']:.1f} ms")

    selection = bench_dgc_selection(grad, args.repeats)
    powersgd = bench_powersgd_vs_hook(grad, args.rank, args.repeats)
    topk_ms = selection["torch_topk_ms"]
    ratios: dict[str, float] = {
        "dgc_selection_speedup_vs_torch_topk": selection["speedup"],
        "dgc_candidates_over_k": selection["candidates_over_k_median"],
        "powersgd_speedup_vs_hook": powersgd["speedup"],
    }
    for name in ("onebit", "terngrad"):
        if name in results:
            ratios[f"{name}_time_over_torch_topk"] = results[name]["exchange_ms"] / topk_ms
    targets = {
        "dgc selection >= 5x faster than torch.topk": selection["speedup"] >= 5,
        "dgc candidates within 20% of k": abs(selection["candidates_over_k_median"] - 1) <= 0.2,
        "powersgd >= 2x faster than hook math": powersgd["speedup"] >= 2,
    }
    for name in ("onebit", "terngrad"):
        key = f"{name}_time_over_torch_topk"
        if key in ratios:
            targets[f"{name} < 1/3 of torch.topk time"] = ratios[key] < 1 / 3

    table = Table(title=f"one exchange round, {shape[0]}x{shape[1]} fp32 on {where}, 1 process")
    for column in ("compressor", "exchange ms", "with memory ms", "wire bytes", "ratio"):
        table.add_column(column, justify="left" if column == "compressor" else "right")
    for name, row in results.items():
        table.add_row(
            name,
            f"{row['exchange_ms']:.1f}",
            f"{row['round_ms']:.1f}",
            f"{row['wire_bytes']:,}",
            f"{row['compression_ratio']:.1f}x",
        )
    table.add_row("torch.topk (exact, 0.001)", f"{topk_ms:.1f}", "", "", "", style="dim")
    table.add_row(
        "dgc selection (sampled)", f"{selection['dgc_select_ms']:.1f}", "", "", "", style="dim"
    )
    table.add_row(
        f"powerSGD_hook math (rank {args.rank})",
        "",
        f"{powersgd['hook_ms']:.1f}",
        "",
        "",
        style="dim",
    )
    table.add_row(
        f"thinwire powersgd (rank {args.rank})",
        "",
        f"{powersgd['thinwire_ms']:.1f}",
        "",
        "",
        style="dim",
    )
    console.print(table)

    summary = Table(title="ratios and targets")
    summary.add_column("figure")
    summary.add_column("value", justify="right")
    for key, value in ratios.items():
        summary.add_row(key, f"{value:.3g}")
    for key, met in targets.items():
        summary.add_row(key, "[green]met[/]" if met else "[red]missed[/]")
    console.print(summary)
    products = Table(title=f"PowerSGD products, rank {args.rank} (ms)")
    products.add_column("product")
    products.add_column("ms", justify="right")
    for key, value in powersgd["products_ms"].items():
        products.add_row(key, f"{value:.1f}")
    console.print(products)

    report = {
        "command": f"python bench/compressors.py --numel {args.numel} --rank {args.rank}"
        + (f" --device {args.device}" if device.type != "cpu" else ""),
        "device": where,
        "shape": list(shape),
        "threads": args.threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "compressors": results,
        "skipped": skipped,
        "dgc_selection": selection,
        "powersgd_vs_hook": powersgd,
        "ratios": ratios,
        "targets": targets,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
