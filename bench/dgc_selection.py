"""DGC's selection of a large tensor against ``torch.topk``: time, what it sends, host waits.

    python bench/dgc_selection.py --device cuda --out results/dgc-selection.json

One tensor of ``--numel`` normal values (the size of a large layer's gradient). For each
density, three ways to choose what DGC sends, each timed as the median of ``--repeats``
calls (device synchronised around each):

* ``torch.topk``: exact top-k of |v| (what DGC would do without a threshold);
* ``dgc exact``: DGC's sampled threshold with retries and a top-k of the candidates
  (``selection="exact"``): exactly the top-k set, reading counts back on the host;
* ``dgc threshold``: about k entries above a sampled threshold, fixed size, nothing read
  back (``selection="threshold"``, the default on a GPU); where Triton is at hand, with
  its fused kernels (:mod:`thinwire.compress.fused`), and also without them
  (``dgc threshold, PyTorch ops``).

Reported per way: milliseconds, speed-up over ``torch.topk``, the share of the exact
top-k's entries it sends (recall), the share of their magnitude it sends, and, on a GPU,
the host synchronisations one call makes (``torch.cuda.set_sync_debug_mode("warn")``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from thinwire.compress import Slot, fused
from thinwire.compress.dgc import DGC


def median_ms(call: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median wall time of ``call`` in ms (after two untimed calls)."""
    call()
    call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def host_waits(call: Callable[[], Any], device: torch.device) -> int | None:
    """Synchronisations one ``call`` makes on a GPU (``None`` on the CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def unfused(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` with PyTorch's operations in place of the fused kernels."""
    available = fused.available
    fused.available = lambda device: False
    try:
        return call(*args)
    finally:
        fused.available = available


def measure(flat: Tensor, density: float, repeats: int) -> dict[str, Any]:
    """The three ways at one density."""
    n, device = flat.numel(), flat.device
    k = max(1, round(n * density))
    magnitude = flat.abs()
    exact = torch.topk(magnitude, k, sorted=False).indices
    exact_set = set(exact.tolist())
    exact_mass = float(magnitude[exact].double().sum())
    slot = Slot("w", 10**6, 1)  # past any warm-up
    ways: dict[str, Callable[[], tuple[Tensor, Tensor]]] = {}
    ways["torch.topk"] = lambda: (torch.topk(flat.abs(), k, sorted=False).indices, flat)
    for selection in ("exact", "threshold"):
        dgc = DGC(density=density, warmup_steps=0, selection=selection)
        ways[f"dgc {selection}"] = lambda dgc=dgc: dgc.pick(flat, k, slot)
    if fused.available(device):  # the threshold selection without its fused kernels too
        dgc = DGC(density=density, warmup_steps=0, selection="threshold")
        ways["dgc threshold, PyTorch ops"] = lambda dgc=dgc: unfused(dgc.pick, flat, k, slot)
    rows = {}
    for name, call in ways.items():
        indices, values = call()
        sent = indices if name == "torch.topk" else indices[values != 0]
        sent_set = set(sent.tolist())
        rows[name] = {
            "ms": median_ms(call, repeats, device),
            "host_waits": host_waits(call, device),
            "sent": len(sent_set),
            "recall": len(sent_set & exact_set) / k,
            "magnitude_share": float(magnitude[sent].double().sum()) / exact_mass,
        }
    base = rows["torch.topk"]["ms"]
    for row in rows.values():
        row["speedup_over_topk"] = base / row["ms"]
    return {"density": density, "k": k, "ways": rows}


def main(argv: list[str] | None = None) -> None:
    """Measure, print, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--densities", default="0.001,0.01")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    flat = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)).to(device)
    results = [measure(flat, float(d), args.repeats) for d in args.densities.split(",")]
    for result in results:
        for name, row in result["ways"].items():
            print(
                f"density {result['density']:<6} {name:<26} {row['ms']:8.3f} ms  "
                f"{row['speedup_over_topk']:5.2f}x topk  recall {row['recall']:.3f}  "
                f"magnitude {row['magnitude_share']:.3f}  waits {row['host_waits']}",
                flush=True,
            )
    record = {
        "command": "python bench/dgc_selection.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "numel": args.numel,
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
