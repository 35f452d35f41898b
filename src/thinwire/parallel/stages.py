"""Cutting a model into pipeline stages at block boundaries.

A stage is a :class:`StageModule`: a copy of the model with every part another stage runs
removed (blocks of other stages, the embedding unless it is the first stage, norm and head
unless it is the last), so its parameters keep the names the whole model gives them.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

from torch import Tensor, nn

from thinwire.parallel.layout import ModelLayout, submodule
from thinwire.parallel.recompute import Recomputation, checkpointed_blocks
from thinwire.parallel.subpipeline import SubBatches


def even_boundaries(blocks: int, stages: int) -> tuple[int, ...]:
    """Where each stage after the first starts, splitting ``blocks`` blocks into ``stages``
    runs as even as they go (the first ones take one more where they cannot be equal)."""
    if stages > blocks:
        raise ValueError(
            f"the model has {blocks} blocks, too few for {stages} pipeline stages (each "
            f"stage holds at least one block): use pp * chunks <= {blocks}"
        )
    base, extra = divmod(blocks, stages)
    starts, start = [], 0
    for stage in range(stages - 1):
        start += base + (1 if stage < extra else 0)
        starts.append(start)
    return tuple(starts)


def stage_ranges(blocks: int, boundaries: Sequence[int]) -> list[range]:
    """The block range of each stage, from the start of each stage after the first."""
    if boundaries and boundaries[-1] >= blocks:
        raise ValueError(
            f"stage boundaries {list(boundaries)} must lie inside the model's {blocks} "
            f"blocks (each < {blocks}), so that every stage holds at least one block"
        )
    edges = [0, *boundaries, blocks]
    return [range(a, b) for a, b in itertools.pairwise(edges)]


def _set_submodule(root: nn.Module, path: str, module: nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    setattr(submodule(root, parent) if parent else root, name, module)


class StageModule(nn.Module):
    """One pipeline stage: the blocks in ``blocks`` of a copy of ``model``, with the
    embedding if ``first`` and the norm and head if ``last``; the last ``recompute`` of its
    blocks run checkpointed (:mod:`thinwire.parallel.recompute`); with ``subbatches > 1``
    it runs each micro-batch as that many sub-batches taking turns
    (:mod:`thinwire.parallel.subpipeline`), each with its own checkpointed segment."""

    def __init__(
        self,
        model: nn.Module,
        layout: ModelLayout,
        blocks: range,
        *,
        first: bool,
        last: bool,
        recompute: float = 0.0,
        subbatches: int = 1,
    ) -> None:
        super().__init__()
        kept = copy.deepcopy(model)
        all_blocks = submodule(kept, layout.blocks)
        _set_submodule(kept, layout.blocks, nn.ModuleDict({str(i): all_blocks[i] for i in blocks}))
        for path in () if first else layout.first:
            _set_submodule(kept, path, None)
        for path in () if last else layout.last:
            _set_submodule(kept, path, None)
        self.model = kept
        self.layout = layout
        self.first, self.last, self.block_range = first, last, blocks
        self.checkpointed = checkpointed_blocks(recompute, len(blocks))
        """How many of the stage's last blocks run checkpointed."""
        self.subbatches = SubBatches(subbatches)
        self.recomputation = Recomputation(subbatches)

    def blocks(self) -> list[nn.Module]:
        """This stage's blocks, in order."""
        return list(submodule(self.model, self.layout.blocks).values())

    def forward(self, x: Tensor) -> Tensor:
        """Tokens (first stage) or hidden states in; hidden states or logits (last) out."""
        trained = [p for p in self.parameters() if p.requires_grad]
        return self.subbatches.run(self._forward, x, trained)

    def _forward(self, x: Tensor) -> Tensor:
        if self.first:
            x = self.layout.embed(self.model, x)
        blocks = self.blocks()
        kept = len(blocks) - self.checkpointed
        if kept:
            x = self._run_blocks(blocks[:kept], x)
        if self.checkpointed:
            segment = blocks[kept:]
            x = self.recomputation.run(
                lambda h: self._run_blocks(segment, h),
                x,
                [p for block in segment for p in block.parameters()],
            )
        if self.last:
            x = self.layout.finish(self.model, x)
        return x

    def recompute_next(self) -> bool:
        """Rebuild the oldest micro-batch's checkpointed blocks now (a schedule's recompute
        action); ``False`` if none is waiting."""
        return self.recomputation.recompute_next()

    def _run_blocks(self, blocks: list[nn.Module], x: Tensor) -> Tensor:
        for block in blocks:
            x = self.layout.run_block(self.model, block, x)
        return x


def model_name(stage_name: str) -> str:
    """A stage's parameter name as the whole model names it."""
    return stage_name.removeprefix("model.")
