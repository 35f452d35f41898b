"""What the sharded-embedding tests share: the sizes, a bag model, each rank's ids, optimizers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB, DIM, CLASSES = 37, 4, 3
STEPS, BATCH, LENGTH = 5, 3, 6


def step_ids(worker: int, step: int) -> torch.Tensor:
    """Ids from a small range (many duplicates, many absent ids), rank- and step-specific."""
    generator = torch.Generator().manual_seed(100 * step + worker)
    return torch.randint(0, VOCAB // 2, (BATCH, LENGTH), generator=generator) * 2


class Bag(nn.Module):
    """Mean of the embeddings of a sequence, then a linear classifier."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embedding = embedding
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(dim=1))


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    """The optimizer ``kind`` (sgd, adam or sparse-adam) over ``params``."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.05)
    return torch.optim.SparseAdam(params, lr=0.05)
