"""One rank's side of a benchmark run: train a task under one method, time every step.

Each step is timed on the rank's own clock in three parts: ``forward`` (batch, forward,
loss), ``backward`` (``loss.backward()``, which under DDP includes waiting for the last
buckets' exchange) and ``optimizer``. Bytes on the wire are read from the kernel's counters
of the host's interface (``/proc/net/dev`` is per network namespace), so every method is
measured the same way, headers and acknowledgements included; on loopback, where all ranks
share one interface, the total is divided by the number of ranks (run as root, the ranks
have a private loopback and count only their own traffic; otherwise the interface is the
machine's, and whatever else runs over it at the same time is counted too). The count runs from the
first measured step to the end and is divided by the exchanges it saw: the measured steps,
plus, under delayed averaging, the exchanges still in flight when the count began (they
send inside it). Over the same steps the worker reads the CPU time its process used (every
thread, user and system): what the method costs a host whose cores are busy computing.
Rank 0 writes its progress to a small file that the parent shows.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from thinwire.bench.methods import Method, prepare, wrap
from thinwire.bench.sleeping import Stage, profile_stages, sleeping_twin
from thinwire.data_parallel.buckets import BucketSpec
from thinwire.tasks import task as build_task


@dataclass(frozen=True)
class BenchJob:
    """What every rank trains: a task, a method, the optimizer settings, the step range
    that counts for the timings (``measure_from`` onwards) and where to report progress."""

    task: str
    method: Method
    steps: int
    lr: float
    task_options: dict[str, Any] = field(default_factory=dict)
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    measure_from: int = 0
    interface: str = "lo"
    progress: str | None = None
    evaluate: bool = True
    bucket_cap_mb: BucketSpec = None  #: a size in MB, "tapered[:TAIL:FACTOR]", None: DDP's
    fuse_rounds: bool = True
    lr_schedule: str = "constant"
    stages: tuple[Stage, ...] | None = None  #: if set, compute sleeps (bench.sleeping)
    broadcast_buffers: bool = True


#: learning-rate schedules a benchmark can run: the factor on ``lr`` at step ``t`` of ``T``
LR_SCHEDULES = {
    "constant": lambda t, total: 1.0,
    "cosine": lambda t, total: 0.5 * (1.0 + math.cos(math.pi * t / total)),
}


def check_lr_schedule(name: str) -> None:
    """Raise a ``ValueError`` naming the choices if ``name`` is not a known schedule."""
    if name not in LR_SCHEDULES:
        raise ValueError(
            f"unknown learning-rate schedule {name!r}; choose from {sorted(LR_SCHEDULES)}"
        )


def interface_bytes(interface: str) -> tuple[int, int]:
    """(received, sent) bytes of ``interface`` in this process's network namespace."""
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, counters = line.partition(":")
        if name.strip() == interface:
            fields = counters.split()
            return int(fields[0]), int(fields[8])
    raise RuntimeError(f"no interface {interface!r} in /proc/net/dev of this namespace")


def train_method(rank: int, world_size: int, job: BenchJob) -> dict[str, Any]:
    """Train ``job.task`` under ``job.method`` on this rank; return timings, losses and
    (on rank 0) the held-out metric."""
    torch.manual_seed(job.seed)
    task = build_task(job.task, seed=job.seed, **job.task_options)
    model = prepare(job.method, task.build_model())
    if job.stages is not None:
        model = sleeping_twin(model, list(job.stages), task.batch(rank, world_size, 0), task.loss)
    own_momentum = job.method.applies_momentum
    momentum = job.method.options.get("momentum")  # ps-async's own, if given
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=job.lr,
        momentum=0.0 if own_momentum else job.momentum if momentum is None else momentum,
        weight_decay=0.0 if own_momentum else job.weight_decay,
    )
    method = job.method
    if own_momentum and job.weight_decay and "weight_decay" not in method.options:
        method = Method(method.name, {**method.options, "weight_decay": job.weight_decay})
    parallel = wrap(
        method, model, optimizer, job.bucket_cap_mb, job.fuse_rounds, job.broadcast_buffers
    )
    wrapped, stepper, engine = parallel.model, parallel.optimizer, parallel.engine
    wrapped.train()
    if dist.is_initialized():
        dist.barrier()
    forward, backward, stepping, losses, ends = [], [], [], [], []
    began = time.perf_counter()
    wire_before = interface_bytes(job.interface)
    cpu_before = time.process_time()
    in_flight = 0  # exchanges started before the byte count began, still sending in it
    factor = LR_SCHEDULES[job.lr_schedule]
    upcoming = task.batch(rank, world_size, 0)
    for step in range(job.steps):
        for group in stepper.param_groups:
            group["lr"] = job.lr * factor(step, job.steps)
        if step == job.measure_from:
            wire_before = interface_bytes(job.interface)
            cpu_before = time.process_time()
            in_flight = getattr(stepper, "pending", 0)
        t0 = time.perf_counter()
        x, y = upcoming
        loss = task.loss(wrapped(x), y)
        if step + 1 < job.steps:  # the next batch, known now (and prefetched, if asked)
            upcoming = task.batch(rank, world_size, step + 1)
            if parallel.lookahead is not None:
                parallel.lookahead(upcoming[0])
        t1 = time.perf_counter()
        stepper.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        stepper.step()
        t3 = time.perf_counter()
        forward.append(t1 - t0)
        backward.append(t2 - t1)
        stepping.append(t3 - t2)
        losses.append(float(loss.detach()))
        ends.append(t3 - began)
        if rank == 0 and job.progress:
            _report(job.progress, step + 1, losses[-1])
    # exchanges in flight now balance those in flight when the count began
    cpu_after = time.process_time()
    parallel.finish()  # every rank holds the agreed weights (DGA, parameter server)
    if dist.is_initialized():
        # a collective can end on one rank while its last sends still wait in the link's
        # queue; the barrier's messages queue behind them, so once it returns they are out
        dist.barrier()
    wire_after = interface_bytes(job.interface)
    parallel.export()  # the model evaluable on rank 0 (not training traffic: not counted)
    measured = slice(job.measure_from, job.steps)
    counted_steps = max(1, job.steps - job.measure_from)
    exchanges = counted_steps + in_flight
    shared = 1 if job.interface != "lo" else world_size
    history = list(engine.history) if engine is not None else []
    if engine is not None and engine.step >= job.steps:  # an exchange a step: the measured
        history = history[-counted_steps:]
    result: dict[str, Any] = {
        "losses": losses,
        "ends_s": ends,
        "step_s": [f + b + s for f, b, s in zip(forward, backward, stepping, strict=True)],
        "forward_s_median": statistics.median(forward[measured]),
        "backward_s_median": statistics.median(backward[measured]),
        "optimizer_s_median": statistics.median(stepping[measured]),
        "cpu_s_per_step": (cpu_after - cpu_before) / counted_steps,
        "sent_bytes_per_step": (wire_after[1] - wire_before[1]) / exchanges / shared,
        "received_bytes_per_step": (wire_after[0] - wire_before[0]) / exchanges / shared,
        "thinwire": _engine_summary(history),
    }
    if engine is not None:
        engine.close()
    plain = getattr(wrapped, "module", wrapped)
    if job.evaluate and rank == 0:
        result["eval_metric"] = task.metric
        result["eval_value"] = task.evaluate(plain)
    if dist.is_initialized():
        dist.barrier()
    return result


def measure_stages(
    rank: int, world_size: int, task_name: str, task_options: dict[str, Any], seed: int
) -> list[Stage]:
    """This rank's stage times of the task's model on its first batch
    (:func:`~thinwire.bench.sleeping.profile_stages`), taken while every rank does the
    same, so the cores are as shared as in training."""
    torch.manual_seed(seed)
    task = build_task(task_name, seed=seed, **task_options)
    return profile_stages(task.build_model(), task.batch(rank, world_size, 0), task.loss)


def probe_allreduce(
    rank: int, world_size: int, sizes: tuple[int, ...], repeats: int = 2
) -> list[float]:
    """Seconds one fp32 all-reduce of each of ``sizes`` elements takes, the fastest of
    ``repeats`` (the caller takes the slowest rank's view); the caller fits the link's
    bandwidth and the fixed cost (latency) of an all-reduce through two of them."""
    warm = torch.ones(1024)
    dist.all_reduce(warm)
    fastest = []
    for numel in sizes:
        payload = torch.ones(numel)
        times = []
        for _ in range(repeats):
            dist.barrier()
            began = time.perf_counter()
            dist.all_reduce(payload)
            times.append(time.perf_counter() - began)
        fastest.append(min(times))
        del payload
    return fastest


def _engine_summary(history: list[Any]) -> dict[str, float] | None:
    if not history:
        return None
    return {
        "payload_bytes_median": statistics.median(s.payload_bytes for s in history),
        "compression_ratio_median": statistics.median(s.compression_ratio for s in history),
        "compress_s_median": statistics.median(s.compress_s for s in history),
        "collective_s_median": statistics.median(s.communicate_s for s in history),
    }


def _report(path: str, step: int, loss: float) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(f"{step} {loss:.6g}")
    os.replace(tmp, path)


def read_progress(path: str) -> tuple[int, float] | None:
    """The (step, loss) rank 0 last reported, or ``None`` before its first step."""
    try:
        step, loss = Path(path).read_text().split()
    except (OSError, ValueError):
        return None
    return int(step), float(loss)
