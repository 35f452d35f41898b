"""Losses on logits sharded by vocabulary over the tensor-parallel group.

:func:`vocab_parallel_cross_entropy` computes the mean token cross entropy from each
rank's slice of the vocabulary: one all-reduce of the row maxima and one of the softmax
denominators and target logits (2 floats per token), where gathering the logits would send
``vocab`` floats per token. A loss function of the user's own gets the logits made whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

LossFn = Callable[[Tensor, Tensor], Tensor]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, group: dist.ProcessGroup) -> Tensor:
        shard = logits.shape[-1]
        start = dist.get_group_rank(group, dist.get_rank()) * shard
        maxima = logits.detach().max(dim=-1).values
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        shifted = logits.detach() - maxima[:, None]
        exp = shifted.exp()
        local = targets - start
        inside = (local >= 0) & (local < shard)
        index = local.clamp(0, shard - 1)
        picked = shifted.gather(-1, index[:, None]).squeeze(-1) * inside
        sums = torch.stack((exp.sum(dim=-1), picked))
        dist.all_reduce(sums, group=group)
        denominators, target_logits = sums
        ctx.save_for_backward(exp / denominators[:, None], index, inside)
        return (denominators.log() - target_logits).mean()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        softmax, index, inside = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, index[:, None], -inside.to(softmax.dtype)[:, None])
        return grad_logits * (grad / softmax.shape[0]), None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, targets: Tensor, group: dist.ProcessGroup, vocab: int
) -> Tensor:
    """The mean cross entropy of ``targets`` (any shape, token ids) under ``logits``
    (``targets``' shape plus this rank's slice of the vocabulary: rank ``i`` of ``group``
    holds ids ``i * vocab / size`` onwards)."""
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be token ids (int64), got {targets.dtype}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(
            f"targets hold ids from {int(targets.min())} to {int(targets.max())}, outside the "
            f"vocabulary of {vocab}: check the tokenizer against the model's vocabulary size"
        )
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match targets of shape "
            f"{tuple(targets.shape)} (logits need one more dimension, the vocabulary)"
        )
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1).long(), group)


def token_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """The mean cross entropy over every token (the single-process counterpart)."""
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )


def sharded_loss(loss_fn: LossFn | None, mesh: DeviceMesh | None, vocab: int) -> LossFn:
    """The loss on the last stage's output: the token cross entropy by default (from the
    vocabulary shards under tensor parallelism), else ``loss_fn`` on whole logits."""
    if mesh is None or mesh.size() == 1:
        return loss_fn or token_cross_entropy
    group = mesh.get_group()
    if loss_fn is None:
        return lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, group, vocab)

    def gathered(logits: Tensor, targets: Tensor) -> Tensor:
        whole = DTensor.from_local(logits, mesh, [Shard(logits.dim() - 1)]).full_tensor()
        return loss_fn(whole, targets)

    return gathered
