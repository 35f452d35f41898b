"""A model's parts profiled once each, and any stage's cost composed from them.

:func:`profile_blocks` profiles the embedding, each distinct kind of block and the head
(one micro-batch, one rank of a ``tp``-way shard, on the fake process group);
:func:`compose_stage` adds up the parts a stage holds, with its recomputation
(:mod:`thinwire.parallel.recompute`); :func:`cost_of` turns stage profiles into the cost
model's :class:`~thinwire.plan.hybrid_cost.StageCost`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from thinwire.plan.stage_profile import (
    StageProfile,
    fake_world,
    in_fresh_process,
    layout_dim,
    profile_stage,
    stage_of,
    task_source,
)
from thinwire.plan.turns import in_subbatches, join_passes, turn_pass


@dataclass(frozen=True)
class BlockProfiles:
    """The parts every stage is made of, each profiled once (one micro-batch, one rank of a
    ``tp``-way shard): ``first`` the embedding alone, ``blocks`` one profile per block of
    the model (blocks of the same kind and shapes share theirs), ``last`` the final norm,
    the head and the loss; ``hidden_bytes``: what a stage sends the next per micro-batch."""

    first: StageProfile
    blocks: tuple[StageProfile, ...]
    last: StageProfile
    hidden_bytes: int


def profile_blocks(
    task_name: str,
    task_options: dict[str, Any],
    plan: Any,
    microbatch: int,
    repeats: int = 3,
    optimizer: str = "adamw",
) -> BlockProfiles:
    """Each distinct part of the task's model under ``plan``'s ``tp`` (and its
    data-parallel method over ``plan.dp`` for the exchange's cost), in a fresh process on
    the fake process group; any stage's cost is then a sum (:func:`compose_stage`)."""
    return in_fresh_process(
        _blocks_in_fake_world, task_name, task_options, plan, microbatch, repeats, optimizer
    )


def _blocks_in_fake_world(
    task_name: str, task_options: dict[str, Any], plan: Any, microbatch: int, repeats: int,
    optimizer: str,
) -> BlockProfiles:  # fmt: skip
    with fake_world(task_source(task_name, task_options), plan, microbatch) as world:
        return block_profiles(world, plan, repeats, optimizer)


def block_profiles(world: Any, plan: Any, repeats: int, optimizer: str) -> BlockProfiles:
    """Each distinct part of ``world``'s model under ``plan``'s ``tp``, on its micro-batch."""
    from thinwire.parallel.layout import submodule

    blocks = submodule(world.model, world.layout.blocks)

    def part(kept: range, first: bool, last: bool) -> StageProfile:
        stage = stage_of(world, plan, kept, first, last)
        return profile_stage(0, stage, world.loss, world.batch, plan, repeats, optimizer)

    kinds: dict[tuple, StageProfile] = {}
    per_block = []
    for index, block in enumerate(blocks):
        kind = (type(block).__name__, tuple(tuple(p.shape) for p in block.parameters()))
        if kind not in kinds:
            kinds[kind] = part(range(index, index + 1), first=False, last=False)
        per_block.append(kinds[kind])
    tokens = world.batch[0]
    return BlockProfiles(
        first=part(range(0), first=True, last=False),
        blocks=tuple(per_block),
        last=part(range(len(blocks), len(blocks)), first=False, last=True),
        hidden_bytes=tokens.shape[0] * tokens.shape[1] * layout_dim(world.model) * 4,
    )


def compose_stage(
    parts: BlockProfiles, blocks: range, *, first: bool, last: bool, recompute: float = 0.0
) -> Any:
    """The cost of a stage holding ``blocks`` (and the embedding if ``first``, the head
    and loss if ``last``): its parts' costs added up (:func:`cost_of`). With
    ``recompute``, its last blocks (:func:`~thinwire.parallel.recompute.checkpointed_blocks`)
    keep only their input per micro-batch and run their forward again before the backward."""
    from thinwire.parallel.recompute import checkpointed_blocks

    chosen = [*([parts.first] if first else []), *(parts.blocks[i] for i in blocks)]
    chosen += [parts.last] if last else []
    if not chosen:
        raise ValueError("a stage holds at least one block, the embedding or the head")
    cost = cost_of(chosen, activation_bytes=0 if last else parts.hidden_bytes)
    count = checkpointed_blocks(recompute, len(blocks))
    if not count:
        return cost
    segment = [parts.blocks[i] for i in blocks[len(blocks) - count :]]
    rebuilt = sum(p.saved_bytes for p in segment)
    n = cost.subbatches
    turns = cost.turns
    if turns is not None:
        turns = (turns[0], turns[1], join_passes([turn_pass(p.forward) for p in segment]))
    return replace(
        cost,
        saved_bytes=cost.saved_bytes - rebuilt + parts.hidden_bytes,
        rebuilt_bytes=rebuilt,
        segment_input_bytes=parts.hidden_bytes,
        after_segment_bytes=parts.last.saved_bytes if last else 0,
        recompute_s=sum(p.forward_s for p in segment),
        recompute_allreduces=tuple(c.nbytes for p in segment for c in p.forward.collectives) * n,
        turns=turns,
    )


def in_subbatches_of(parts: BlockProfiles, subbatches: int) -> BlockProfiles:
    """``parts`` profiled on one sub-batch, as the parts of a micro-batch of
    ``subbatches`` of them (:func:`thinwire.plan.turns.in_subbatches`)."""
    if subbatches == 1:
        return parts
    return BlockProfiles(
        first=in_subbatches(parts.first, subbatches),
        blocks=tuple(in_subbatches(p, subbatches) for p in parts.blocks),
        last=in_subbatches(parts.last, subbatches),
        hidden_bytes=parts.hidden_bytes * subbatches,
    )


def cost_of(profiles: Sequence[StageProfile], activation_bytes: int) -> Any:
    """The planner's :class:`thinwire.plan.hybrid_cost.StageCost` of one rank running the
    parts ``profiles`` one after another, sending ``activation_bytes`` on per micro-batch:
    times, collectives, bytes and the data-parallel exchange's buckets added up."""
    from thinwire.plan.hybrid_cost import StageCost

    exchange = join_method_costs([p.dp_cost for p in profiles if p.dp_cost is not None])
    parts = profiles[0].subbatches

    def each(collectives: list[Any]) -> tuple[int, ...]:
        return tuple(c.nbytes for c in collectives) * parts

    loss = tuple(c.nbytes for p in profiles for c in p.loss_collectives)
    recomputing = [p for p in profiles if p.recompute]
    turns = None
    if parts > 1:
        turns = (
            join_passes([turn_pass(p.forward) for p in profiles]),
            join_passes([turn_pass(p.backward) for p in profiles]),
            join_passes([turn_pass(p.recompute) for p in recomputing]),
        )
    return StageCost(
        forward_s=sum(p.forward_s for p in profiles),
        backward_s=sum(p.backward_s for p in profiles),
        forward_allreduces=each([c for p in profiles for c in p.forward.collectives]),
        backward_allreduces=each([c for p in profiles for c in p.backward.collectives]) + loss,
        activation_bytes=activation_bytes,
        dp_cost=exchange,
        optimizer_s=sum(p.optimizer_s for p in profiles),
        parameter_bytes=sum(
            4 * torch.Size(shape).numel() for p in profiles for shape in p.parameter_shapes
        ),
        optimizer_state_bytes=sum(p.optimizer_state_bytes for p in profiles),
        exchange_bytes=sum(p.exchange_bytes for p in profiles),
        saved_bytes=sum(
            p.saved_bytes - p.recompute_saved + (p.input_bytes if p.recompute else 0)
            for p in profiles
        ),
        recompute_s=sum(p.recompute_s for p in recomputing),
        recompute_allreduces=each([c for p in recomputing for c in p.recompute.collectives]),
        rebuilt_bytes=sum(p.recompute_saved for p in recomputing),
        segment_input_bytes=sum(p.input_bytes for p in recomputing),
        after_segment_bytes=sum(p.tail_saved_bytes for p in recomputing),
        subbatches=parts,
        turns=turns,
        loss_allreduces=loss,
    )


def join_method_costs(costs: Sequence[Any]) -> Any:
    """One :class:`~thinwire.plan.cost.MethodCost` for parts exchanged together (their
    buckets one after another); ``None`` for none."""
    from thinwire.plan.cost import MethodCost

    if len(costs) <= 1:
        return costs[0] if costs else None
    return MethodCost(
        costs[0].method,
        tuple(b for c in costs for b in c.buckets),
        dense_bytes=sum(c.dense_bytes for c in costs),
        options=costs[0].options,
        schedule=costs[0].schedule,
    )
