"""Weights that two pipeline stages share (GPT-2 ties its token embedding to its head).

Each stage holding a tied weight keeps a copy; after the backward pass the copies' gradients
are summed over the stages that hold them, so every copy takes the step the one shared
weight would take, and the copies stay equal (they start equal, and see the same updates).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from thinwire.comm.collectives import run_collective
from thinwire.parallel.layout import ModelLayout
from thinwire.parallel.mesh import group_across_stages
from thinwire.parallel.plan import ParallelPlan
from thinwire.parallel.stages import StageModule, model_name


def tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter the model registers under more than one name."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def stage_of(name: str, layout: ModelLayout, ranges: Sequence[range]) -> int:
    """The index of the stage that holds parameter ``name`` of the whole model."""
    prefix = layout.blocks + "."
    if name.startswith(prefix):
        block = int(name[len(prefix) :].split(".", 1)[0])
        return next(i for i, r in enumerate(ranges) if block in r)
    if any(name.startswith(path + ".") for path in layout.first):
        return 0
    if any(name.startswith(path + ".") for path in layout.last):
        return len(ranges) - 1
    return 0


class TiedGradients:
    """Sums, over the pipeline ranks that hold them, the gradients of weights tied across
    stages; nothing to do when every tie stays within one stage."""

    def __init__(
        self,
        model: nn.Module,
        layout: ModelLayout,
        ranges: Sequence[range],
        plan: ParallelPlan,
        stages: Sequence[StageModule],
    ) -> None:
        self.links: list[tuple[dist.ProcessGroup, list[nn.Parameter]]] = []
        held = {model_name(n): p for s in stages for n, p in s.named_parameters()}
        for names in tied_names(model):
            holders = sorted({stage_of(n, layout, ranges) % plan.pp for n in names})
            if len({stage_of(n, layout, ranges) for n in names}) == 1:
                continue
            if plan.tp > 1:
                raise ValueError(
                    f"{' and '.join(names)} are one tied weight, which thinwire cannot yet "
                    "shard over tensor parallelism when pipeline stages hold its copies; "
                    "build the model with its weights untied (tie_word_embeddings=False)"
                )
            group = group_across_stages(plan, holders)
            mine = [held[n] for n in names if n in held]
            if group is not None and mine:
                self.links.append((group, mine))

    def sum_gradients(self) -> None:
        """Add up the tied copies' gradients (collective over the holders)."""
        for group, params in self.links:
            for p in params:
                run_collective("the tied weights' all-reduce", dist.all_reduce, p.grad, group=group)
