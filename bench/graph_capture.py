"""Can a step's exchange be captured in a CUDA graph, and what would that save? A probe for
issue 31's next step (DGC's added time under 2 ms on the ResNet-18).

    python bench/graph_capture.py --methods dgc,none,powersgd --out results/graph-capture.json

One GPU, a world of one on NCCL. The image task's ResNet-18 (width 32, 62 gradient
tensors) as one bucket: its gradients side by side in one flat buffer, as in a DDP bucket.
thinwire's :class:`~thinwire.comm.engine.GradientExchange` refuses a non-finite step on
the device (a fused SGD's ``found_inf``), so that a steady-state step makes the host wait
for nothing. Per method, each in a process of its own (a capture that fails can leave CUDA
or NCCL unusable):

1. ``--warmup`` steps taken eagerly by two engines built alike, A and B;
2. B's next two steps (one for each of the memory's two buffer sets) captured in two CUDA
   graphs (``torch.cuda.graph``, NCCL's collective inside), the step's means put side by
   side in one tensor inside each graph;
3. the two graphs replayed on the same gradients that A takes the same two steps on
   eagerly: the means compared to the bit;
4. ``--timed`` steps each way, alternating: the host's time in the call (eager: the
   exchange; replay: ``graph.replay()``) and the wall time to the GPU's end.

What a replay does not do, and why this is a probe and not the engine's path: it keeps
the captured step's random draws (DGC's sample offset is drawn on the host and is frozen
into the graph: replays past the second are for timing only); the engine's step counter,
statistics and the report of a refused step to the host (a pinned copy and an event,
skipped while capturing here) do not move. A failed capture is a result too: the error
and the line it came from say what stands in the way (``thread_local``, the default
``--mode``, stops a capture at the first call that cannot be captured, on this thread).

``--collectives local`` takes NCCL out: the world of one's collectives become what they
leave in their tensors (an all-reduce leaves its tensor, an all-gather copies its input),
so that thinwire's own math is captured alone; ``nccl-only`` (a method name here) captures
one NCCL all-reduce and all-gather and nothing of thinwire.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.batch import GradientItem
from thinwire.comm.device_refusal import DeviceRefusal
from thinwire.comm.engine import GradientExchange
from thinwire.compress.registry import compressor as build_compressor
from thinwire.launch import free_port
from thinwire.tasks.resnet import ResNet18

OPTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "fp16": {},
    "powersgd": {"rank": 2},
    "dgc": {"density": 0.01, "warmup_steps": 0},
    "topk": {"density": 0.01},
    "onebit": {},
    "terngrad": {},
    "nccl-only": {},
}


class _Done:
    """What a local collective returns where an asynchronous one was asked for."""

    def wait(self) -> bool:
        return True


def local_collectives() -> None:
    """Replace ``torch.distributed``'s collectives by what a world of one's leave in their
    tensors, so that nothing of NCCL is captured."""

    def all_reduce(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kw: Any) -> Any:
        return _Done() if async_op else None

    def broadcast(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kw: Any) -> Any:
        return _Done() if async_op else None

    def all_gather_into_tensor(
        output: torch.Tensor, input: torch.Tensor, *args: Any, async_op: bool = False, **kw: Any
    ) -> Any:
        output.view(-1).copy_(input.reshape(-1))
        return _Done() if async_op else None

    def all_gather(
        outputs: list[torch.Tensor], input: torch.Tensor, *args: Any, async_op: bool = False,
        **kw: Any,
    ) -> Any:  # fmt: skip
        outputs[0].copy_(input)
        return _Done() if async_op else None

    dist.all_reduce, dist.broadcast = all_reduce, broadcast
    dist.all_gather_into_tensor, dist.all_gather = all_gather_into_tensor, all_gather


def nccl_only(mode: str) -> dict[str, Any]:
    """One NCCL all-reduce and one all-gather captured, replayed and checked."""
    x = torch.arange(1024, dtype=torch.float32, device="cuda")
    gathered = torch.empty_like(x)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    row: dict[str, Any] = {"method": "nccl-only"}
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode=mode):
            dist.all_reduce(x)
            dist.all_gather_into_tensor(gathered, x)
    except Exception as error:
        return {**row, **failure(error)}
    x.copy_(torch.arange(1024, dtype=torch.float32, device="cuda") * 2)
    graph.replay()
    torch.cuda.synchronize()
    expected = torch.arange(1024, dtype=torch.float32, device="cuda") * 2
    row["captured"] = True
    row["replay_equal"] = [bool(torch.equal(x, expected) and torch.equal(gathered, expected))]
    return row


def failure(error: BaseException) -> dict[str, Any]:
    """A failed capture's row fields: the error and the frames it came through."""
    return {
        "captured": False,
        "error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
        "where": [
            line
            for line in traceback.format_exc().strip().splitlines()
            if line.startswith("  File") or line.startswith("    ")
        ][-24:],
    }


def capturing() -> bool:
    """Whether this thread's current CUDA stream is being captured."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class ProbeRefusal(DeviceRefusal):
    """The engine's refusal on the device, less the report to the host while a graph is
    captured (its pinned copy and event would be the graph's, not a step's)."""

    def settle(self, step: int, flags: list[torch.Tensor]) -> torch.Tensor:
        """As :meth:`DeviceRefusal.settle`; while capturing, the flag alone."""
        if not capturing():
            return super().settle(step, flags)
        flags = [flag.reshape(()).bool() for flag in flags]
        refused = flags[0] if len(flags) == 1 else torch.stack(flags).any()
        self.flag = refused
        return refused

    def poll(self) -> None:
        """As :meth:`DeviceRefusal.poll`, except while capturing (nothing to report)."""
        if not capturing():
            super().poll()


class Bucket:
    """One engine exchanging the ResNet-18's gradients as one flat bucket."""

    def __init__(self, method: str, device: torch.device) -> None:
        torch.manual_seed(0)
        model = ResNet18(width=32).to(device)
        named = list(model.named_parameters())
        sizes = [p.numel() for _, p in named]
        self.flat = torch.zeros(sum(sizes), device=device)
        for (_, param), grad in zip(named, self.flat.split(sizes), strict=True):
            param.grad = grad.view(param.shape)
        self.items = [GradientItem(name, p.grad, p) for name, p in named]
        optimizer = torch.optim.SGD([p for _, p in named], lr=0.01, fused=True)
        optimizer.step()  # the refusal on the device begins after the optimizer's first step
        self.engine = GradientExchange(build_compressor(method, **OPTIONS[method]))
        self.engine.device_refusal = ProbeRefusal(optimizer)
        self.tensors = len(named)

    def step(self) -> torch.Tensor:
        """One step's exchange; the means side by side in one new tensor."""
        ((_, means),) = self.engine.exchange_bucket(self.items, last=True, whole=self.flat)
        return torch.cat([mean.reshape(-1).float() for mean in means])


def gradients(numel: int, steps: int, device: torch.device) -> list[torch.Tensor]:
    """``steps`` gradients of ``numel`` values, seeded."""
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(numel, generator=generator) * 1e-2).to(device) for _ in range(steps)]


def probe(method: str, warmup: int, timed: int, mode: str) -> dict[str, Any]:
    """Steps 1-4 of the module docstring for ``method``, in this process; ``mode``: the
    capture's error mode."""
    if method == "nccl-only":
        return nccl_only(mode)
    device = torch.device("cuda", 0)
    a, b = Bucket(method, device), Bucket(method, device)
    grads = gradients(a.flat.numel(), 4, device)
    for step in range(warmup):
        for bucket in (a, b):
            bucket.flat.copy_(grads[step % 2])
            bucket.step()
    torch.cuda.synchronize()
    row: dict[str, Any] = {"method": method, "options": OPTIONS[method], "tensors": a.tensors}
    graphs, outs = [], []
    try:
        for _parity in range(2):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode=mode):
                outs.append(b.step())
            graphs.append(graph)
    except Exception as error:  # what stands in the way of a capture is the finding
        return {**row, **failure(error)}
    row["captured"] = True
    equal, largest = [], []
    for parity in range(2):  # the two captured steps against A's same two steps
        a.flat.copy_(grads[2 + parity])
        b.flat.copy_(grads[2 + parity])
        eager = a.step()
        graphs[parity].replay()
        torch.cuda.synchronize()
        equal.append(bool(torch.equal(eager, outs[parity])))
        largest.append(float((eager - outs[parity]).abs().max()))
    row["replay_equal"], row["replay_max_abs_diff"] = equal, largest
    eager_host, eager_wall, replay_host, replay_wall = [], [], [], []
    for step in range(timed):
        a.flat.copy_(grads[step % 2])
        b.flat.copy_(grads[step % 2])
        torch.cuda.synchronize()
        started = time.perf_counter()
        a.step()
        eager_host.append(time.perf_counter() - started)
        torch.cuda.synchronize()
        eager_wall.append(time.perf_counter() - started)
        started = time.perf_counter()
        graphs[step % 2].replay()
        replay_host.append(time.perf_counter() - started)
        torch.cuda.synchronize()
        replay_wall.append(time.perf_counter() - started)
    for name, times in (
        ("eager_host_ms", eager_host),
        ("eager_wall_ms", eager_wall),
        ("replay_host_ms", replay_host),
        ("replay_wall_ms", replay_wall),
    ):
        row[name] = statistics.median(times) * 1e3
    return row


def one(method: str, warmup: int, timed: int, mode: str, collectives: str) -> dict[str, Any]:
    """:func:`probe` in a world of one on NCCL (``collectives="local"``: without it)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    if collectives == "local":
        local_collectives()
    try:
        return {**probe(method, warmup, timed, mode), "mode": mode, "collectives": collectives}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Each method in a process of its own; print and write the rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="dgc,none,powersgd")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--timed", type=int, default=40)
    parser.add_argument("--limit", type=float, default=120.0, help="seconds per method")
    parser.add_argument(
        "--mode", default="thread_local", choices=["global", "thread_local", "relaxed"]
    )
    parser.add_argument("--collectives", default="nccl", choices=["nccl", "local"])
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child's method
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_capture.py needs a CUDA device: it probes CUDA graphs")
    if args.one:
        print(json.dumps(one(args.one, args.warmup, args.timed, args.mode, args.collectives)))
        return
    rows = []
    for method in args.methods.split(","):
        if method not in OPTIONS:
            raise SystemExit(f"unknown method {method!r}; one of {', '.join(OPTIONS)}")
        command = [sys.executable, __file__, "--one", method, "--warmup", str(args.warmup)]
        command += ["--timed", str(args.timed), "--mode", args.mode]
        command += ["--collectives", args.collectives]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.limit)
            lines = done.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "method": method, "captured": False, "error": f"exit {done.returncode}",
                "where": done.stderr.strip().splitlines()[-30:],
            }  # fmt: skip
        except subprocess.TimeoutExpired:
            row = {"method": method, "captured": False, "error": f"over {args.limit} s"}
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "command": "python bench/graph_capture.py " + " ".join(argv or sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0),
            "rows": rows,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
