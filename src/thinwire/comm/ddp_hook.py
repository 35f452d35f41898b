"""The DDP front end: ``thinwire.register(ddp_model, "dgc", density=0.001)``.

(No ``from __future__ import annotations`` here: DDP inspects the hook's annotations.)

DDP calls a communication hook once per gradient bucket, in bucket order on every rank, and
waits for the returned futures at the end of the backward pass. thinwire's hook queues the
bucket's exchange on the engine's ordered thread and returns at once, so compression and
communication of early buckets overlap the rest of the backward pass. The future resolves
to the bucket buffer holding the averaged gradients; the last bucket closes the step.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from thinwire.comm.collectives import Communicator
from thinwire.comm.engine import GradientExchange, GradientItem
from thinwire.compress.base import Compressor, Memory
from thinwire.compress.registry import compressor as build_compressor


@dataclass
class HookState:
    """What the hook needs: the engine and each parameter's name by identity."""

    engine: GradientExchange
    names: dict[int, str]


def register(
    model: DistributedDataParallel,
    compressor: str | Compressor = "none",
    *,
    communicator: str | Communicator = "auto",
    optimizer: torch.optim.Optimizer | None = None,
    memory: Memory | None = None,
    **options: Any,
) -> GradientExchange:
    """Make ``model`` (a DDP module) exchange gradients through ``compressor``.

    Args:
        model: a ``DistributedDataParallel`` model, before its first backward pass.
        compressor: a registered name (``thinwire.compressors()`` lists them) or an instance.
        communicator: ``"auto"``, ``"allreduce"`` or ``"allgather"``.
        optimizer: if given, checked against the compressor (DGC applies momentum itself,
            so an optimizer that adds its own momentum is refused with an explanation).
        memory: override the compressor's default error-feedback memory.
        **options: compressor options when ``compressor`` is a name (e.g. ``density``).

    Returns:
        The :class:`GradientExchange` engine: per-step statistics (``last_step``,
        ``history``) and ``state_dict()``/``load_state_dict()`` for checkpoints.
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"register() needs a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(model).__name__}; wrap it with DDP first, or use "
            "thinwire.DistributedOptimizer for code without DDP"
        )
    built = build_compressor(compressor, **options)
    if optimizer is not None:
        built.check_optimizer(optimizer)
    group = getattr(model, "process_group", None)
    if group is not None and group is dist.GroupMember.WORLD:
        group = None
    engine = GradientExchange(built, communicator=communicator, memory=memory, group=group)
    named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
    engine.verify((n, p.shape) for n, p in named)
    model.register_comm_hook(HookState(engine, {id(p): n for n, p in named}), compressed_hook)
    return engine


def compressed_hook(
    state: HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average one bucket through the engine, asynchronously."""
    buffer = bucket.buffer()
    params = bucket.parameters()
    views, offset = [], 0
    for param in params:
        views.append(buffer[offset : offset + param.numel()].view(param.shape))
        offset += param.numel()
    items = [
        GradientItem(state.names[id(p)], view, p) for p, view in zip(params, views, strict=True)
    ]
    is_last = bucket.is_last()
    engine = state.engine

    def job() -> torch.Tensor:
        means = engine.exchange(items)
        for view, mean in zip(views, means, strict=True):
            view.copy_(mean)
        if is_last:
            engine.end_step()
        return buffer

    return engine.submit(job)
