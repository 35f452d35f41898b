"""``thinwire.parallelize(model, "auto")``: plan on the live cluster, then run the plan.

    trainer = thinwire.parallelize(model, "auto", optimizer=..., example_inputs=(x, y),
                                   memory_limit="8GiB")
    print(trainer.plan)                                   # logged too; save it:
    trainer = thinwire.parallelize(model, "4x2x1/mb8/1f1b/stages4", optimizer=...)

With ``"auto"``, every rank measures the links (:func:`thinwire.plan.probe.run_probe`,
unless a probe is given), rank 0 profiles the model's parts on the example global batch in
a fresh process and searches every plan (:mod:`thinwire.plan.search`), and every rank
receives the chosen plan, which :func:`thinwire.parallel.parallelize` then runs. A plan
written as ``thinwire plan`` and ``thinwire bench --plans`` write them is read as it is.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from thinwire.parallel import ModelLayout, ParallelPlan, ParallelTrainer
from thinwire.parallel import parallelize as parallelize_plan
from thinwire.parallel.plan_spec import parse_plan

log = logging.getLogger("thinwire")


def auto_plan(
    model: nn.Module,
    example_inputs: tuple[Tensor, Tensor],
    *,
    memory_limit: int | str | None = None,
    probe: Any = None,
    ranks_per_host: int | None = None,
    space: Any = None,
    optimizer: str = "adamw",
    cache: str | Path | None = None,
) -> ParallelPlan:
    """The planner's choice for ``model`` on the running group (every rank calls this and
    gets the same plan). ``probe``: a :class:`~thinwire.plan.probe.LinkProbe` or its file
    (default: measured now); ``ranks_per_host``: default torchrun's ``LOCAL_WORLD_SIZE``."""
    from thinwire.cluster.units import parse_bytes
    from thinwire.plan.hybrid_command import plan_for
    from thinwire.plan.model_source import ModelSource
    from thinwire.plan.probe import LinkProbe, run_probe

    if not dist.is_initialized():
        raise RuntimeError(
            'parallelize(model, "auto") plans for the running ranks: call '
            "torch.distributed.init_process_group first (torchrun sets the environment)"
        )
    if example_inputs is None:
        raise ValueError(
            'parallelize(model, "auto") profiles the model on a global batch: pass '
            "example_inputs=(tokens, targets) as trainer.step will take them"
        )
    limit = parse_bytes(memory_limit) if isinstance(memory_limit, str) else memory_limit
    if isinstance(probe, str | Path):
        probe = LinkProbe.load(probe)
    if probe is None:
        per_host = ranks_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        probe = run_probe(per_host)
    chosen: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            source = ModelSource.of_module(model, example_inputs)
            result, _ = plan_for(
                source, probe, limit, space or _default_space(model), optimizer=optimizer,
                cache=Path(cache) if cache else None, log=log.info,
            )  # fmt: skip
            best = result.chosen
            log.info(
                "thinwire plan: %s, predicted %.3f s a step, %.2f GiB peak per rank "
                "(%d plans searched; runner-up %s)",
                best.label, best.prediction.step_s, best.prediction.peak_memory_bytes / 2**30,
                len(result.prepared), result.ranked[1].label if len(result.ranked) > 1 else "none",
            )  # fmt: skip
            chosen[0] = best.label
        except Exception as error:  # every rank raises it, not only rank 0
            chosen[0] = error
    dist.broadcast_object_list(chosen, src=0)
    if isinstance(chosen[0], Exception):
        raise chosen[0]
    return parse_plan(chosen[0])


def parallelize(
    model: nn.Module,
    plan: ParallelPlan | str = "auto",
    *,
    optimizer: Any = None,
    loss_fn: Any = None,
    layout: ModelLayout | None = None,
    example_inputs: tuple[Tensor, Tensor] | None = None,
    memory_limit: int | str | None = None,
    probe: Any = None,
    **engine_options: Any,
) -> ParallelTrainer:
    """Run ``model`` under ``plan`` (a :class:`ParallelPlan`, a plan written as
    ``"4x2x1/mb8/1f1b"``, or ``"auto"``: the planner's choice for this cluster, which needs
    ``example_inputs``, the global batch, and takes ``memory_limit`` per rank, e.g.
    ``"8GiB"``). The rest as :func:`thinwire.parallel.parallelize`."""
    if isinstance(plan, str):
        if plan == "auto":
            if layout is not None:
                raise ValueError(
                    'parallelize(model, "auto") profiles models thinwire can read itself; '
                    "with a layout of your own, pass a ParallelPlan"
                )
            plan = auto_plan(model, example_inputs, memory_limit=memory_limit, probe=probe)
            if dist.get_rank() == 0:
                log.info("thinwire runs plan %s", plan.spec())
        else:
            plan = parse_plan(plan)
    return parallelize_plan(
        model, plan, optimizer=optimizer, loss_fn=loss_fn, layout=layout, **engine_options
    )


def _default_space(model: Any) -> Any:
    """The search's default space; without sub-batches for a model on a GPU (they run on
    CPU ranks in this version: :mod:`thinwire.parallel.subpipeline`)."""
    from thinwire.plan.search import SearchSpace

    on_gpu = any(p.is_cuda for p in model.parameters())
    return SearchSpace(subbatches=(1,)) if on_gpu else SearchSpace()
