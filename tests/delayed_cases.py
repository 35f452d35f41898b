"""What the delayed-averaging tests share: the model every rank trains, flattened tensors."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def seeded_model() -> nn.Module:
    """The small model every rank builds, from the same seed."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def flat(tensors) -> np.ndarray:
    """``tensors`` as one flat NumPy copy."""
    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy().copy()
