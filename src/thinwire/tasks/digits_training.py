"""Data-parallel training of the digits MLP under a thinwire compressor (one rank's loop).

Used by ``thinwire demo`` and by the tests that show each compressor trains a real model.
Every rank draws its batches from its own shard with a generator seeded by (seed, rank,
step), so a run is a pure function of its config and a resumed run needs no loader state.

    run_local(train_digits, 4, args=(DigitsRun(method="dgc", options={"density": 0.01}),))
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import thinwire
from thinwire.tasks.digits import DigitsMLP, accuracy, load_digits_data, shard


@dataclass(frozen=True)
class DigitsRun:
    """One training run's configuration.

    ``method``: a compressor name, or ``"ddp"`` for DDP's built-in all-reduce (no hook).
    ``front_end``: ``"ddp"`` (communication hook) or ``"optimizer"`` (DistributedOptimizer).
    ``stop_after``/``checkpoint``: save a checkpoint after that many steps and stop;
    ``resume``: continue from a checkpoint up to ``steps``.
    """

    method: str = "none"
    options: dict[str, Any] = field(default_factory=dict)
    steps: int = 300
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.9
    hidden: int = 256
    seed: int = 0
    front_end: str = "ddp"
    stop_after: int | None = None
    checkpoint: str | None = None
    resume: str | None = None


def _batch(x: torch.Tensor, y: torch.Tensor, run: DigitsRun, rank: int, step: int):
    gen = torch.Generator().manual_seed(run.seed * 1_000_003 + rank * 10_007 + step)
    idx = torch.randint(len(y), (run.batch_size,), generator=gen)
    return x[idx], y[idx]


def train_digits(rank: int, world_size: int, run: DigitsRun) -> dict[str, Any]:
    """Train on this rank's shard; return loss, test accuracy, traffic and final weights."""
    data = load_digits_data(seed=run.seed)
    x, y = shard(data.train_x, data.train_y, rank, world_size)
    torch.manual_seed(run.seed)
    model: nn.Module = DigitsMLP(run.hidden)
    own_momentum = (
        run.method != "ddp" and thinwire.compressor(run.method, **run.options).applies_momentum
    )
    momentum = 0.0 if own_momentum else run.momentum
    optimizer = torch.optim.SGD(model.parameters(), lr=run.lr, momentum=momentum)
    engine: thinwire.GradientExchange | None = None
    stepper: Any = optimizer
    if run.front_end == "ddp":
        model = DistributedDataParallel(model)
        if run.method != "ddp":
            engine = thinwire.register(model, run.method, optimizer=optimizer, **run.options)
    elif run.front_end == "optimizer":
        stepper = thinwire.DistributedOptimizer(optimizer, model, run.method, **run.options)
        engine = stepper.engine
    else:
        raise ValueError(f"front_end must be 'ddp' or 'optimizer', got {run.front_end!r}")

    start = 0
    if run.resume is not None:
        state = torch.load(Path(run.resume) / f"rank{rank}.pt", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if engine is not None:
            engine.load_state_dict(state["thinwire"])
        start = state["step"]

    losses = []
    began = time.perf_counter()
    last = run.steps if run.stop_after is None else run.stop_after
    for step in range(start, last):
        bx, by = _batch(x, y, run, rank, step)
        loss = nn.functional.cross_entropy(model(bx), by)
        stepper.zero_grad()
        loss.backward()
        stepper.step()
        losses.append(float(loss.detach()))
    wall_s = time.perf_counter() - began

    if run.checkpoint is not None:
        Path(run.checkpoint).mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "step": last,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "thinwire": engine.state_dict() if engine is not None else None,
            },
            Path(run.checkpoint) / f"rank{rank}.pt",
        )
    history = list(engine.history) if engine is not None else []
    plain = model.module if isinstance(model, DistributedDataParallel) else model
    dist.barrier()
    return {
        "method": run.method,
        "final_loss": float(np.mean(losses[-20:])) if losses else float("nan"),
        "test_accuracy": accuracy(plain, data.test_x, data.test_y),
        "wall_s": wall_s,
        "steps": len(losses),
        "payload_bytes_per_step": float(np.mean([s.payload_bytes for s in history]))
        if history
        else float("nan"),
        "compression_ratio": float(np.median([s.compression_ratio for s in history]))
        if history
        else 1.0,
        "compress_s_per_step": float(np.mean([s.compress_s for s in history])) if history else 0.0,
        "weights": [p.detach().numpy().copy() for p in plain.parameters()],
    }
