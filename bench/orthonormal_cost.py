"""What orthonormalising a step's PowerSGD factors costs, per way of doing it.

    python bench/orthonormal_cost.py --device cuda --out results/orthonormal-cost.json

The image task's ResNet-18 (width 32): the P factors PowerSGD orthonormalises each step
at ``--rank``, in its stacks of same-shaped matrices. Ways, each over all the stacks of
one step:

* ``qr per stack``: thinwire's (``torch.linalg.qr`` of each stack, Householder);
* ``gram-schmidt per stack``: PyTorch's ``powerSGD_hook`` (its Gram-Schmidt at ranks up
  to 2, the QR above that);
* ``qr, one padded stack``: every stack padded with zero rows to the longest, one QR;
* ``householder, one padded``: padded so, one Householder orthonormalisation written in
  PyTorch's operations (``thinwire.compress.powersgd_bucket.householder_rows``, what
  PowerSGD's bucket layout runs; its padding copies here are one index copy there).

Reported per way: the host's time to launch it (no wait inside), the time to its end
(device synchronised), both medians of ``--repeats``, and the largest departure from
orthonormality (``|P^T P - I|``) it leaves.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

from thinwire.compress.powersgd import PowerSGD, orthonormal_rows
from thinwire.compress.powersgd_bucket import householder_rows
from thinwire.tasks.resnet import ResNet18


def stacks(rank: int, device: torch.device) -> list[Tensor]:
    """One step's P^T stacks (count x rank x rows), random, as PowerSGD groups them."""
    compressor = PowerSGD(rank=rank)
    shapes: Counter[tuple[int, int]] = Counter()
    for parameter in ResNet18(width=32).parameters():
        if compressor.compresses(parameter):
            n, m = parameter.shape[0], parameter.numel() // parameter.shape[0]
            shapes[(n, m)] += 1
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(count, min(rank, n, m), n, generator=generator).to(device)
        for (n, m), count in sorted(shapes.items())
    ]


def qr_per_stack(pts: list[Tensor]) -> list[Tensor]:
    """thinwire's way: one QR per stack."""
    return [orthonormal_rows(pt) for pt in pts]


def gram_schmidt_per_stack(pts: list[Tensor]) -> list[Tensor]:
    """PyTorch's hook's way, per stack (in its layout)."""
    out = []
    for pt in pts:
        p = pt.transpose(1, 2).contiguous()  # the hook's layout: count x rows x rank
        _orthogonalize(p)
        out.append(p.transpose(1, 2))
    return out


def one_padded_stack(pts: list[Tensor], orthonormalise: Callable[[Tensor], Tensor]) -> list[Tensor]:
    """Every stack padded with zero rows to the longest, ``orthonormalise`` once for all,
    each stack's part cut out again."""
    rows = max(pt.shape[2] for pt in pts)
    padded = pts[0].new_zeros(sum(pt.shape[0] for pt in pts), pts[0].shape[1], rows)
    start = 0
    for pt in pts:
        padded[start : start + pt.shape[0], :, : pt.shape[2]] = pt
        start += pt.shape[0]
    q = orthonormalise(padded)
    out, start = [], 0
    for pt in pts:
        out.append(q[start : start + pt.shape[0], :, : pt.shape[2]])
        start += pt.shape[0]
    return out


def qr_one_padded_stack(pts: list[Tensor]) -> list[Tensor]:
    """One QR for every stack, padded."""
    return one_padded_stack(pts, orthonormal_rows)


def householder_one_padded_stack(pts: list[Tensor]) -> list[Tensor]:
    """thinwire's on a GPU (``PowerSGD.layout="bucket"``): one Householder
    orthonormalisation in PyTorch's operations for every stack, padded."""
    return one_padded_stack(pts, householder_rows)


WAYS: dict[str, Callable[[list[Tensor]], list[Tensor]]] = {
    "qr per stack": qr_per_stack,
    "gram-schmidt per stack": gram_schmidt_per_stack,
    "qr, one padded stack": qr_one_padded_stack,
    "householder, one padded": householder_one_padded_stack,
}


def measure(way: Callable, pts: list[Tensor], repeats: int, device: torch.device) -> dict:
    """Host launch time and time to the end, medians in us; orthonormality error."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        way(pts)
    launch, total = [], []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        way(pts)
        launched = time.perf_counter()
        sync()
        ended = time.perf_counter()
        launch.append(launched - started)
        total.append(ended - started)
    error = 0.0
    for q in way(pts):
        gram = q @ q.transpose(1, 2)
        eye = torch.eye(gram.shape[1], device=device, dtype=gram.dtype)
        error = max(error, float((gram - eye).abs().max()))
    return {
        "launch_us": statistics.median(launch) * 1e6,
        "total_us": statistics.median(total) * 1e6,
        "orthonormality_error": error,
    }


def main(argv: list[str] | None = None) -> None:
    """Measure each way, print, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    pts = stacks(args.rank, device)
    print(f"{len(pts)} stacks: " + ", ".join(f"{tuple(pt.shape)}" for pt in pts), flush=True)
    rows: dict[str, Any] = {}
    for name, way in WAYS.items():
        rows[name] = measure(way, pts, args.repeats, device)
        row = rows[name]
        print(
            f"{name:<24} launch {row['launch_us']:8.1f} us  to the end {row['total_us']:8.1f} us"
            f"  |PtP - I| {row['orthonormality_error']:.1e}",
            flush=True,
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "command": "python bench/orthonormal_cost.py " + " ".join(argv or sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "stacks": [list(pt.shape) for pt in pts],
            "ways": rows,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
