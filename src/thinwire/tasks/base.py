"""The task interface: a model, sharded batches and a held-out metric, loaded offline.

A task is everything the benchmark needs to train one real model data-parallel and judge
the result, and nothing about distribution: the runner wraps the model (DDP, a thinwire
hook, ...), the task only says what to train on.

    task = thinwire.tasks.task("fashion", batch_size=32)
    model = task.build_model()                       # same weights for the same seed
    x, y = task.batch(rank, world_size, step)        # this rank's shard, a pure function
    loss = task.loss(model(x), y)
    value = task.evaluate(model)                     # task.metric: "accuracy" / "perplexity"

Batches are a pure function of ``(seed, rank, world_size, step)``: a resumed run needs no
loader state and every method of a benchmark sees the same data.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
from torch import Tensor, nn

T = TypeVar("T")


class Task(ABC):
    """A training task: subclasses are dataclasses whose fields are the task's options."""

    name: ClassVar[str]
    summary: ClassVar[str]
    #: name of the held-out metric that :meth:`evaluate` returns
    metric: ClassVar[str]
    #: whether a larger metric is better (accuracy) or worse (perplexity)
    higher_is_better: ClassVar[bool]

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model; the same weights for the same ``seed`` option."""

    @abstractmethod
    def batch(self, rank: int, world_size: int, step: int) -> tuple[Tensor, Tensor]:
        """Inputs and targets of ``rank``'s batch at ``step`` (from its own shard)."""

    @abstractmethod
    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The training loss of the model's ``output`` against ``target``."""

    @abstractmethod
    def evaluate(self, model: nn.Module) -> float:
        """The held-out metric (:attr:`metric`) of ``model``, in evaluation mode."""

    def describe(self) -> dict[str, Any]:
        """Name, metric and options, for results files."""
        import dataclasses

        options = dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}
        return {"task": self.name, "metric": self.metric, "options": options}


def step_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """A fresh generator for ``rank``'s batch at ``step``: a pure function of its arguments.

    The three numbers are mixed with NumPy's ``SeedSequence``, so distinct triples give
    unrelated streams (no ``seed * a + rank * b + step`` collisions between ranks and steps).
    """
    key = np.random.SeedSequence([seed, rank, step]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(key))


def seeded_init(seed: int, build: Callable[[], T]) -> T:
    """``build()`` under ``torch.manual_seed(seed)`` without touching the global RNG after.

    The global generator's state is saved and restored around the call, so building a
    model neither depends on nor disturbs whatever the caller drew before.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def check_rank(rank: int, world_size: int, examples: int | None = None, step: int = 0) -> None:
    """Raise ``ValueError`` unless ``0 <= rank < world_size``, ``step >= 0`` (all integers)
    and, given the training set's size, every rank's shard has an example."""
    for name, value in (("rank", rank), ("world_size", world_size), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..world_size-1, got rank {rank} of {world_size}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if examples is not None and world_size > examples:
        raise ValueError(
            f"{world_size} ranks for {examples} training examples leave some ranks none: "
            "use at most one rank per example"
        )
