"""What the framework drivers share: the model, the data, the compressors, the report."""

from __future__ import annotations

import sys

import torch
from torch.utils.data import TensorDataset

from thinwire.tasks.digits import DigitsMLP, load_digits_data

#: compressors checked in every framework: deterministic ones resume bit for bit
COMPRESSORS = {
    "dgc": {"density": 0.05, "momentum": 0.9, "warmup_steps": 0},  # compressed from step 0
    "powersgd": {"rank": 2},
    "randomk": {"density": 0.1},
}


def model() -> DigitsMLP:
    """The same small digits perceptron on every rank."""
    torch.manual_seed(0)
    return DigitsMLP(hidden=64)


def dataset(examples: int = 96) -> TensorDataset:
    """The first ``examples`` training digits."""
    data = load_digits_data()
    return TensorDataset(data.train_x[:examples], data.train_y[:examples])


def weights(module: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of ``module``'s parameters."""
    return [p.detach().clone() for p in module.parameters()]


def arguments() -> tuple[str, ...]:
    """The command line after the script's name."""
    return tuple(sys.argv[1:])
