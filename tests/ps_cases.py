"""What the parameter-server tests share: a run's settings, the model, batches, a server."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

import thinwire

STEPS = 6
BATCH = 5


@dataclass(frozen=True)
class Run:
    """One training run: how the ranks exchange, with which compressor and optimizer."""

    front_end: str = "ps"  # or "allreduce": thinwire.DistributedOptimizer
    mode: str = "sync"
    servers: int = 1
    colocated: bool = True
    compressor: str = "none"
    options: dict = field(default_factory=dict)
    momentum: float = 0.9
    staleness: int = 1
    slow_rank_sleep: float = 0.0
    steps: int = STEPS


def seeded_model() -> nn.Module:
    """The small model every rank builds, from the same seed."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def worker_batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s inputs and targets at ``step``."""
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator)


def build_server(model: nn.Module, run: Run, world: int) -> thinwire.ParameterServer:
    """A parameter server over ``model`` with ``run``'s settings, on ``world`` ranks."""
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=run.momentum)
    return thinwire.ParameterServer(
        sgd,
        model,
        run.compressor,
        mode=run.mode,
        servers=min(run.servers, world),
        colocated=run.colocated,
        staleness=run.staleness,
        **run.options,
    )
