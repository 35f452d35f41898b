"""Block sparsity: send the blocks of B contiguous values with the largest norms, one index
per block.

The seeds' first cure for sparse exchanges that densify: coarse-grained sparsity. Blocks
of a tensor's flat layout (a row's neighbouring weights) are chosen by their L2 norm;
each block travels as B fp32 values and one int32 block index, ``4 B + 4`` bytes, against
``8 B`` for the same values chosen one by one. Ranks' choices overlap more at block
granularity, and the index bytes shrink B-fold. The last block of a tensor whose size is
not a multiple of B is padded with zeros (never sent past the end).
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.base import Request


def blocks_for(k: int, block: int, numel: int) -> int:
    """How many blocks carry about ``k`` values: ``ceil(k / block)``, at most all."""
    return min(math.ceil(numel / block), max(1, math.ceil(k / block)))


def pick_blocks(flat: Tensor, count: int, block: int) -> tuple[Tensor, Tensor]:
    """The ``count`` blocks of ``flat`` with the largest L2 norms: their block indices
    (int64) and their values (``count * block``, zeros past the tensor's end)."""
    padded = _padded(flat, block)
    norms = padded.square().sum(dim=1)
    chosen = torch.topk(norms, count, sorted=False).indices
    return chosen, padded.index_select(0, chosen).reshape(-1)


def element_indices(chosen: Tensor, block: int, numel: float) -> Tensor:
    """The flat indices of the values inside the blocks ``chosen``, in the order their
    values travel (past the tensor's ``numel`` left out)."""
    inside = chosen.long().unsqueeze(1) * block + torch.arange(block, device=chosen.device)
    inside = inside.reshape(-1)
    return inside[inside < numel]


def gather_blocks(
    values: Tensor, chosen: Tensor, like: Tensor, block: int, world_size: int
) -> Generator[Request, Any, Tensor]:
    """Gather every rank's blocks (values, int32 block indices) and return their mean,
    added into a tensor shaped as the flat ``like``."""
    gathered = yield Request.gather(values, chosen.to(torch.int32))
    numel = like.numel()
    total = torch.zeros(math.ceil(numel / block) * block, dtype=like.dtype, device=like.device)
    rows = total.view(-1, block)
    for rank_values, rank_blocks in gathered:
        rows.index_add_(0, rank_blocks.long(), rank_values.view(-1, block))
    return total[:numel].div_(world_size)


def _padded(flat: Tensor, block: int) -> Tensor:
    """``flat`` as rows of ``block`` values, the last padded with zeros."""
    rows = math.ceil(flat.numel() / block)
    if rows * block == flat.numel():
        return flat.view(rows, block)
    padded = flat.new_zeros(rows * block)
    padded[: flat.numel()] = flat
    return padded.view(rows, block)
