"""The digits MLP (:mod:`thinwire.tasks.digits`) under the task interface, for fast tests."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from thinwire.tasks.base import Task, check_rank, seeded_init, step_generator
from thinwire.tasks.digits import DigitsData, DigitsMLP, load_digits_data
from thinwire.tasks.registry import register_task


@functools.lru_cache(maxsize=4)
def _data(seed: int) -> DigitsData:
    return load_digits_data(seed=seed)


@register_task
@dataclass(frozen=True)
class DigitsTask(Task):
    """scikit-learn's 8x8 digits with a two-hidden-layer MLP; metric: test accuracy.

    Options:
        seed: the train/test split, model initialisation and batch sampling.
        batch_size: examples per rank per step, drawn with replacement from the rank's
            shard (every ``world_size``-th training example, starting at ``rank``).
        hidden: width of the two hidden layers.
    """

    name = "digits"
    summary = "sklearn 8x8 digits (1438 train), 2-hidden-layer MLP (0.1 M params); accuracy"
    metric = "accuracy"
    higher_is_better = True

    seed: int = 0
    batch_size: int = 32
    hidden: int = 256

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.hidden < 1:
            raise ValueError(
                f"batch_size and hidden must be positive, got {self.batch_size}, {self.hidden}"
            )

    @property
    def data(self) -> DigitsData:
        """The standardised split (loaded once per process and seed)."""
        return _data(self.seed)

    def build_model(self) -> nn.Module:
        """A ``DigitsMLP``, initialised from ``seed``."""
        return seeded_init(self.seed, lambda: DigitsMLP(self.hidden))

    def batch(self, rank: int, world_size: int, step: int) -> tuple[Tensor, Tensor]:
        """Inputs (batch_size, 64) and labels (batch_size,) from ``rank``'s shard."""
        data = self.data
        check_rank(rank, world_size, len(data.train_y), step)
        shard_size = len(range(rank, len(data.train_y), world_size))
        pick = torch.randint(
            shard_size, (self.batch_size,), generator=step_generator(self.seed, rank, step)
        )
        idx = rank + world_size * pick
        return data.train_x[idx], data.train_y[idx]

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Cross-entropy of the logits against the labels."""
        return nn.functional.cross_entropy(output, target)

    def evaluate(self, model: nn.Module) -> float:
        """Accuracy on the held-out split, in eval mode."""
        data = self.data
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                predicted = model(data.test_x).argmax(dim=1)
        finally:
            model.train(was_training)
        return float((predicted == data.test_y).float().mean())
