"""``thinwire.parallelize``: the one place the parallelisms are composed, in a fixed order.

    trainer = thinwire.parallelize(model, thinwire.ParallelPlan(dp=2, pp=2, tp=2),
                                   optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4))
    loss = trainer.step(tokens, targets)     # the same global batch on every rank

1. read the model's layout (blocks, embedding, head, projections) and check the plan
   against it and the world; check that every rank runs the same plan and starts from the
   same weights;
2. build the mesh ``("pp", "dp", "tp")``;
3. cut the stages this rank runs (:mod:`~thinwire.parallel.stages`);
4. shard them over ``"tp"`` (:func:`~thinwire.parallel.tensor.apply_tensor_parallel`);
5. build the optimizer over what this rank holds, and average its gradients over ``"dp"``
   (:func:`~thinwire.parallel.data.apply_data_parallel`);
6. schedule the stages over ``"pp"`` (:func:`~thinwire.parallel.pipeline.apply_pipeline`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire.comm.agreement import parameter_layout, ranks_differing
from thinwire.errors import RankMismatchError
from thinwire.parallel.data import OptimizerSpec, apply_data_parallel, build_optimizer
from thinwire.parallel.layout import ModelLayout, read_layout, submodule
from thinwire.parallel.loss import LossFn, sharded_loss
from thinwire.parallel.mesh import build_mesh
from thinwire.parallel.pipeline import apply_pipeline
from thinwire.parallel.plan import CHUNKS_PER_RANK, ParallelPlan
from thinwire.parallel.stages import StageModule, even_boundaries, model_name, stage_ranges
from thinwire.parallel.tensor import apply_tensor_parallel, check_tensor_parallel
from thinwire.parallel.tied import TiedGradients
from thinwire.parallel.trainer import ParallelTrainer


def parallelize(
    model: nn.Module,
    plan: ParallelPlan,
    *,
    optimizer: OptimizerSpec | None = None,
    loss_fn: LossFn | None = None,
    layout: ModelLayout | None = None,
    **engine_options: Any,
) -> ParallelTrainer:
    """Run ``model`` under ``plan`` on every rank of the default group; return the trainer.

    Args:
        model: a language model thinwire can read (see :func:`read_layout`), built the
            same on every rank (same seed). thinwire copies the parts this rank runs.
        plan: the degrees and schedule; the same on every rank.
        optimizer: a function of the parameters returning an optimizer, or an optimizer
            built over ``model`` (rebuilt, same class and settings, over this rank's shards).
        loss_fn: ``loss_fn(logits, targets)``, a mean over the micro-batch; default: token
            cross entropy (computed from vocabulary shards under tensor parallelism; a
            loss of your own gets the logits made whole, ``vocab`` floats per token).
        layout: where the model's parts are, for a model :func:`read_layout` cannot read.
        **engine_options: passed to :class:`~thinwire.DistributedOptimizer` (``bucket_cap_mb``,
            ``communicator``, ...).
    """
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan must be a thinwire.ParallelPlan, got {type(plan).__name__}")
    layout = layout or read_layout(model)
    blocks = len(submodule(model, layout.blocks))
    check_tensor_parallel(layout, plan.tp)
    boundaries = plan.stages or even_boundaries(blocks, plan.chunks)
    ranges = stage_ranges(blocks, boundaries)
    mesh = build_mesh(plan)
    check_same_weights(model)

    pp_rank = mesh["pp"].get_local_rank()
    indices = [pp_rank + k * plan.pp for k in range(CHUNKS_PER_RANK[plan.schedule])]
    stages = [
        StageModule(
            model,
            layout,
            ranges[i],
            first=i == 0,
            last=i == plan.chunks - 1,
            recompute=plan.recompute[i] if plan.recompute else 0.0,
            subbatches=plan.subbatches,
        )
        for i in indices
    ]
    tied = TiedGradients(model, layout, ranges, plan, stages)
    if plan.tp > 1:
        for stage in stages:
            apply_tensor_parallel(stage, mesh["tp"])
    named = [
        (model_name(name), p)
        for stage in stages
        for name, p in stage.named_parameters()
        if p.requires_grad
    ]
    local = build_optimizer(optimizer, [p for _, p in named])
    stepper = apply_data_parallel(named, local, mesh["dp"], plan, **engine_options)
    loss = sharded_loss(loss_fn, mesh["tp"] if plan.tp > 1 else None, layout.vocab)
    pipeline = apply_pipeline(stages, indices, plan, mesh["pp"], loss)
    return ParallelTrainer(plan, mesh, stages, pipeline, stepper, loss, tied)


def weight_fingerprint(model: nn.Module) -> str:
    """A digest of exact values sampled from every parameter (bytes, no arithmetic, so
    machines that sum differently still agree)."""
    sha = hashlib.sha1()
    with torch.no_grad():
        for _, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 256)][:256]
            sha.update(sample.cpu().numpy().tobytes())
    return sha.hexdigest()


def check_same_weights(model: nn.Module) -> None:
    """Raise :class:`RankMismatchError` on every rank if the ranks' models differ in their
    parameters' names and shapes or their starting values."""
    layouts, values = ranks_differing(
        [parameter_layout(model.named_parameters()), weight_fingerprint(model)], None
    )
    if layouts or values:
        differing = layouts or values
        what = "parameters (names, shapes or dtypes)" if layouts else "starting weights"
        raise RankMismatchError(
            f"rank {dist.get_rank()}'s model and rank(s) {', '.join(map(str, differing))}' "
            f"differ in their {what}: build the same model on every rank after "
            "torch.manual_seed(<same seed>) (or load the same checkpoint) before parallelize"
        )
