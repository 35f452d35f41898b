"""Why an optimizer step after a sparsifier's exchange can cost more: ``sqrt`` of zeros.

    OMP_NUM_THREADS=1 python bench/zero_moment.py

Prints the median time of ``torch.sqrt`` over 4 M values that are random positive, zero,
or 1 % nonzero, and of AdamW's step over 27 M parameters fed ten times with dense
gradients or with gradients 1 % nonzero (what DGC's averages look like), each after a
warm-up. Adam's second moment stays zero wherever no gradient arrived, and it takes the
moment's square root every step (docs/planner-measurements.md, the afternoon of 2026-11-28).
"""

from __future__ import annotations

import statistics
import time

import torch


def _median_s(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    """Print both tables."""
    torch.manual_seed(0)
    n = 4_000_000
    out = torch.empty(n)
    values = {
        "random positive": torch.rand(n) + 1e-3,
        "zeros": torch.zeros(n),
        "1 % nonzero": torch.rand(n) * (torch.rand(n) < 0.01),
    }
    print(f"torch.sqrt over {n:,} values ({torch.backends.cpu.get_cpu_capability()} kernels)")
    for name, x in values.items():
        seconds = _median_s(lambda x=x: torch.sqrt(x, out=out), 20)
        print(f"  {name:16s} {seconds * 1e3:6.2f} ms")
    print("AdamW step over 27 M parameters, after ten steps of:")
    for name, share in (("dense gradients", 1.0), ("1 % nonzero", 0.01)):
        params = [torch.nn.Parameter(torch.randn(2048, 512)) for _ in range(26)]
        step = torch.optim.AdamW(params, lr=1e-3)
        times = []
        for _ in range(10):
            for p in params:
                grad = torch.randn_like(p)
                p.grad = grad if share == 1.0 else grad * (torch.rand_like(p) < share)
            start = time.perf_counter()
            step.step()
            times.append(time.perf_counter() - start)
        print(f"  {name:16s} {statistics.median(times[3:]) * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
