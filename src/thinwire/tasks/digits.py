"""Handwritten digits (scikit-learn's bundled ``load_digits``: 1797 8x8 images, 10 classes).

The data ships inside scikit-learn, so nothing is downloaded. A fixed-seed split gives
1438 training and 359 test images, standardised with the training set's statistics; each
rank trains on its own shard of the training set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class DigitsData:
    """Standardised train/test tensors."""

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor


def load_digits_data(seed: int = 0, test_fraction: float = 0.2) -> DigitsData:
    """Load the digits from scikit-learn's package data and split them with ``seed``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # pragma: no cover - a dev dependency
        raise ImportError(
            "the digits task needs scikit-learn (pip install scikit-learn)"
        ) from error
    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_test = round(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    mean = images[train].mean(axis=0)
    std = images[train].std(axis=0) + 1e-6

    def prepared(idx: np.ndarray) -> tuple[Tensor, Tensor]:
        x = torch.tensor((images[idx] - mean) / std, dtype=torch.float32)
        return x, torch.tensor(labels[idx], dtype=torch.int64)

    train_x, train_y = prepared(train)
    test_x, test_y = prepared(test)
    return DigitsData(train_x, train_y, test_x, test_y)


def shard(x: Tensor, y: Tensor, rank: int, world_size: int) -> tuple[Tensor, Tensor]:
    """This rank's strided share of a dataset (every ``world_size``-th example)."""
    return x[rank::world_size], y[rank::world_size]


class DigitsMLP(nn.Module):
    """A two-hidden-layer perceptron for 8x8 digits: 64 -> hidden -> hidden -> 10."""

    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(64, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape (batch, 10) for inputs of shape (batch, 64)."""
        return self.layers(x)


def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Fraction of ``x`` that ``model`` classifies correctly."""
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())
