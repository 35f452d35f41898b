"""thinwire's own cost per step: DDP with thinwire's hook against DDP alone, compute near zero.

    python bench/host_cost.py --out docs/results/host-cost-cpu.json
    python bench/host_cost.py --device cuda --layers 62 --out results/host-cost-gpu.json
    python bench/host_cost.py --device cuda --model resnet18 --batch 32 --out results/r18.json

A world of one process (gloo on the CPU, NCCL on a GPU), a model of ``--layers`` linear
layers of ``--width`` x ``--width`` (two parameter tensors each) and a batch of ``--batch``
rows, so that the step is almost all bookkeeping: what the hook adds to DDP's step is
thinwire's host path (kernel launches per tensor, host synchronisations, the exchange
thread), not bytes or compute. ``--model resnet18``: the image task's ResNet-18 (width 32,
62 parameter tensors, 28x28 one-channel images, cross-entropy) instead, a real model's
tensors and compute, for the GPU table. Every method runs the same SGD steps on its own copy of
the model; ``ddp`` is DDP's own all-reduce (no hook), ``torch-powersgd`` and
``torch-fp16`` are PyTorch's ``powerSGD_hook`` (same rank as thinwire's PowerSGD, no
warm-up) and ``fp16_compress_hook``.

The methods are timed in ``--rounds`` rounds, each method's steps once per round in an
order that alternates from round to round; a method's step time is the median of all its
timed steps. Reported per method: the median step, the time it adds to DDP's step, and
its step over DDP's, and for thinwire's methods the exchange thread's median time per step
in thinwire's own math (memory, compressor, bookkeeping) and in collectives (from the
engine's step statistics). Read the ratios: they come from one run side by side.

To compare two versions of thinwire, run this file twice with ``PYTHONPATH`` pointing at
each version's ``src`` (the JSON records which one it imported).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import thinwire
from thinwire.launch import free_port
from thinwire.tasks.resnet import ResNet18

#: thinwire's compressors and the options they run with here
THINWIRE: dict[str, dict[str, Any]] = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "powersgd": {"rank": 2},
    # at its density from the first step: with DGC's default warm-up (1000 steps) every
    # step a benchmark times would send 25 % of each tensor (runs before 2026-11-27 did)
    "dgc": {"density": 0.01, "warmup_steps": 0},
    "topk": {"density": 0.01},
    "randomk": {"density": 0.01},
    "onebit": {},
    "signsgd": {},
    "terngrad": {},
    "qsgd": {},
}
REFERENCES = ["ddp", "torch-powersgd", "torch-fp16"]
#: rows added with --variant: label -> (compressor, options)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {}


def parse_variant(text: str) -> tuple[str, str, dict[str, Any]]:
    """``LABEL=METHOD:NAME=VALUE,...`` as (label, method, options); values are read as
    Python literals where they parse (numbers, True/False/None), else kept as text."""
    label, sep, rest = text.partition("=")
    method, _, spec = rest.partition(":")
    if not sep or not label or not method:
        raise SystemExit(f"--variant {text!r}: write LABEL=METHOD:NAME=VALUE,...")
    options: dict[str, Any] = {}
    for pair in filter(None, spec.split(",")):
        key, eq, value = pair.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: option {pair!r} needs NAME=VALUE")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return label, method, options


def build_model(layers: int, width: int, device: torch.device) -> nn.Module:
    """``layers`` linear layers of ``width`` x ``width`` with a ReLU between them."""
    torch.manual_seed(0)
    parts: list[nn.Module] = []
    for i in range(layers):
        parts.append(nn.Linear(width, width))
        if i < layers - 1:
            parts.append(nn.ReLU())
    return nn.Sequential(*parts).to(device)


def build(args: argparse.Namespace, device: torch.device) -> nn.Module:
    """The model ``--model`` names, on ``device``, the same weights for every method."""
    if args.model == "resnet18":
        torch.manual_seed(0)
        return ResNet18(width=32).to(device)
    return build_model(args.layers, args.width, device)


def wrap(
    method: str, model: nn.Module, device: torch.device, fused: bool = False
) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    """``model`` under DDP with ``method``'s communication hook, and its SGD (``fused``:
    the fused one, which thinwire's hook is given, so that it refuses a step on the GPU
    without a host wait)."""
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, fused=fused or None)
    if method == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=THINWIRE["powersgd"]["rank"],
            start_powerSGD_iter=2,
            use_error_feedback=True,
            warm_start=True,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif method == "torch-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method != "ddp":
        name, options = VARIANTS[method] if method in VARIANTS else (method, THINWIRE[method])
        given = {"optimizer": optimizer} if fused else {}
        ddp.thinwire_engine = thinwire.register(ddp, name, **given, **options)  # type: ignore[assignment]
    return ddp, optimizer


class Runner:
    """One method's model, optimizer and fixed batch; :meth:`steps` times steps."""

    def __init__(self, method: str, args: argparse.Namespace, device: torch.device) -> None:
        self.method = method
        self.device = device
        self.model, self.optimizer = wrap(method, build(args, device), device, args.fused)
        generator = torch.Generator().manual_seed(1)
        if args.model == "resnet18":
            self.inputs = torch.randn(args.batch, 1, 28, 28, generator=generator).to(device)
            self.labels = torch.randint(0, 10, (args.batch,), generator=generator).to(device)
        else:
            self.inputs = torch.randn(args.batch, args.width, generator=generator).to(device)
            self.labels = None
        self.times: list[float] = []
        self.loss = float("nan")

    def step(self) -> None:
        """One training step."""
        self.optimizer.zero_grad(set_to_none=False)
        out = self.model(self.inputs)
        if self.labels is None:
            loss = out.square().mean()
        else:
            loss = nn.functional.cross_entropy(out, self.labels)
        loss.backward()
        self.optimizer.step()
        self.last = loss

    def steps(self, count: int, record: bool) -> None:
        """``count`` steps; with ``record``, keep each one's time."""
        for _ in range(count):
            sync(self.device)
            started = time.perf_counter()
            self.step()
            sync(self.device)
            if record:
                self.times.append(time.perf_counter() - started)
        self.loss = float(self.last.detach())


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that host clocks time it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Time every method; return the JSON record."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    chosen = list(THINWIRE) if args.methods == "all" else args.methods.split(",")
    unknown = sorted(set(chosen) - set(THINWIRE))
    if unknown:
        known = ", ".join(THINWIRE)
        raise SystemExit(f"unknown method(s) {', '.join(unknown)}; choose from {known}")
    methods = REFERENCES + [m for m in THINWIRE if m in chosen] + list(VARIANTS)
    runners = [Runner(m, args, device) for m in methods]
    for runner in runners:
        runner.steps(args.warmup, record=False)
    for round_index in range(args.rounds):
        order = runners if round_index % 2 == 0 else runners[::-1]
        for runner in order:
            runner.steps(args.steps, record=True)
    ddp_step = statistics.median(runners[0].times)
    rows = []
    for runner in runners:
        step = statistics.median(runner.times)
        engine = getattr(runner.model, "thinwire_engine", None)
        history = list(engine.history)[-len(runner.times) :] if engine is not None else []
        rows.append(
            {
                "method": runner.method,
                "options": VARIANTS[runner.method][1]
                if runner.method in VARIANTS
                else THINWIRE.get(runner.method, {}),
                "step_ms": step * 1e3,
                "added_ms": (step - ddp_step) * 1e3,
                "vs_ddp": step / ddp_step,
                "steps_timed": len(runner.times),
                # the exchange thread's time in thinwire's math and in collectives
                "engine_math_ms": statistics.median(h.compress_s for h in history) * 1e3
                if history
                else None,
                "engine_collectives_ms": statistics.median(h.communicate_s for h in history) * 1e3
                if history
                else None,
                "final_loss": runner.loss,
            }
        )
    model = runners[0].model.module
    return {
        "command": "python bench/host_cost.py " + " ".join(args.argv),
        "thinwire_src": os.path.dirname(os.path.dirname(thinwire.__file__)),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "parameter_tensors": len(list(model.parameters())),
        "model": args.model,
        "layers": args.layers,
        "width": args.width,
        "batch": args.batch,
        "fused_sgd": args.fused,
        "rows": rows,
    }


def print_table(record: dict[str, Any]) -> None:
    """The record as a table."""
    table = Table(
        title=f"{record['parameter_tensors']} parameter tensors on {record['device']}, "
        f"{record['thinwire_src']}"
    )
    columns = ("method", "step ms", "added ms", "vs DDP", "engine math ms", "collectives ms")
    for column in columns:
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in record["rows"]:
        step, added, ratio = row["step_ms"], row["added_ms"], row["vs_ddp"]
        math_ms, comm_ms = row.get("engine_math_ms"), row.get("engine_collectives_ms")
        table.add_row(
            row["method"],
            f"{step:.3f}",
            f"{added:+.3f}",
            f"{ratio:.2f}x",
            "" if math_ms is None else f"{math_ms:.3f}",
            "" if comm_ms is None else f"{comm_ms:.3f}",
        )
    Console().print(table)


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, measure, print and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--model", choices=["linear", "resnet18"], default="linear")
    parser.add_argument("--layers", type=int, default=32, help="linear layers (2 tensors each)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per method")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per method and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--methods", default="all", help="comma-separated, or all")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=METHOD:NAME=VALUE,...",
        help="one more row: a compressor with other options, timed beside the rest, e.g. "
        "dgc-exact=dgc:density=0.01,selection=exact (repeatable)",
    )
    parser.add_argument(
        "--fused",
        action="store_true",
        help="every method with SGD(fused=True), which thinwire's hook is given: a step "
        "with a NaN is then skipped on the GPU, with no host wait for the verdict",
    )
    parser.add_argument("--out", type=Path, help="write the JSON record here")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    for text in args.variant:
        label, method, options = parse_variant(text)
        if method not in THINWIRE or label in THINWIRE or label in REFERENCES:
            raise SystemExit(f"--variant {text!r}: a new label for one of {', '.join(THINWIRE)}")
        VARIANTS[label] = (method, options)
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    try:
        record = measure(args)
    finally:
        dist.destroy_process_group()
    print_table(record)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
