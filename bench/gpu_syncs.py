"""Host synchronisations in a steady-state step of DDP with thinwire's hook, on a GPU.

    python bench/gpu_syncs.py --out results/gpu-syncs.json

One process, NCCL, one CUDA device: a model of ``--layers`` linear layers (two parameter
tensors each) under DDP with thinwire's hook trains ``--warmup`` steps, then one step
under ``torch.cuda.set_sync_debug_mode("warn")``, which warns at every operation that
makes the host wait for the GPU. Each warning is recorded with the line of thinwire (or
PyTorch) that asked for it. ``ddp`` (no hook) is the reference. Needs a CUDA device;
``tests/test_gpu_sync.py`` runs :func:`count_syncs` where one is present.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import thinwire
from host_cost import THINWIRE  # bench/ is on the path when this file runs
from thinwire.launch import free_port

#: compressors and the options they run with here: those of ``host_cost.py``
METHODS: dict[str, dict[str, Any]] = {"ddp": {}, **THINWIRE}


def count_syncs(
    method: str, layers: int = 8, width: int = 256, warmup: int = 3, fused: bool = False
) -> dict[str, Any]:
    """Train ``method`` (in a process where the default group is NCCL on device 0) and
    return the synchronisations of one steady-state step: their count and where
    (``fused``: with a fused SGD given to thinwire, which refuses a step on the device)."""
    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
    ddp = DistributedDataParallel(model, device_ids=[0])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, fused=fused or None)
    if method != "ddp":
        given = {"optimizer": optimizer} if fused else {}
        thinwire.register(ddp, method, **given, **METHODS[method])
    inputs = torch.randn(16, width, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        ddp(inputs).square().mean().backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    seen: list[dict[str, Any]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for warning in caught:
        if "synchroniz" in str(warning.message):
            seen.append({"where": f"{warning.filename}:{warning.lineno}"})
    places: dict[str, int] = {}
    for entry in seen:
        places[entry["where"]] = places.get(entry["where"], 0) + 1
    return {"method": method, "syncs": len(seen), "where": places}


def main(argv: list[str] | None = None) -> None:
    """Count every method's synchronisations; print and write them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--width",
        type=int,
        default=256,
        help="layer width: 256 keeps every weight among the small tensors compressors take "
        "side by side (65,536 values); 512 makes each weight a large one (alone, but for "
        "DGC's threshold selection, which takes large ones side by side too)",
    )
    parser.add_argument(
        "--fused", action="store_true", help="a fused SGD, given to thinwire (no verdict read)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    rows = []
    try:
        for method in args.methods.split(","):
            try:
                row = count_syncs(method, width=args.width, fused=args.fused)
            except Exception:  # one broken method must not hide the others' counts
                row = {"method": method, "error": traceback.format_exc(limit=4)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()
    record = {
        "command": "python bench/gpu_syncs.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "width": args.width,
        "fused_sgd": args.fused,
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
