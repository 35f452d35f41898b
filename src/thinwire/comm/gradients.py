"""A parameter's gradient as the exchange takes it: made zeros where a rank has none,
refused if sparse, and a tensor-parallel shard's local part."""

from __future__ import annotations

import sys

import torch
from torch import Tensor


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``DTensor``, without importing ``torch.distributed.tensor``
    (and ``torch._dynamo`` with it) in a process that has made none: a data-parallel
    rank's imports take half the CPU time."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def gradient_of(name: str, param: Tensor) -> Tensor:
    """``param``'s gradient, made zeros where it has none (so every rank issues the same
    collectives); a sparse one is refused with what to do; a ``DTensor``'s is laid out as
    its parameter and gives this rank's shard (what its data-parallel peers average)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    if is_dtensor(param.grad):
        if param.grad.placements != param.placements:  # an embedding's comes back whole
            param.grad = param.grad.redistribute(param.device_mesh, param.placements)
        return param.grad.to_local()
    if param.grad.layout != torch.strided:
        raise TypeError(
            f"the gradient of {name!r} is sparse ({param.grad.layout}), as nn.Embedding("
            "sparse=True) makes it; thinwire exchanges dense gradients. Build the layer with "
            "sparse=False, or shard the table with thinwire.data_parallel.sparse (its rows "
            "travel sparsely)."
        )
    return param.grad
