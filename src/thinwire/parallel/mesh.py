"""The device mesh of a plan: the only place thinwire makes the groups of hybrid
parallelism.

Ranks are laid out ``("pp", "dp", "tp")`` with tensor parallelism innermost: rank
``r = (pp_index * dp + dp_index) * tp + tp_index``. Every group gets the default group's
timeout (``init_device_mesh`` would give gloo's 30 minutes), so a dead peer raises
within the time the user asked for.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from thinwire.comm.agreement import ranks_differing
from thinwire.comm.collectives import group_timeout
from thinwire.errors import CommunicationError, RankMismatchError
from thinwire.parallel.plan import ParallelPlan

DIMENSIONS = ("pp", "dp", "tp")


def rank_grid(plan: ParallelPlan) -> torch.Tensor:
    """The global ranks as a ``(pp, dp, tp)`` grid."""
    return torch.arange(plan.world_size).reshape(plan.pp, plan.dp, plan.tp)


def groups_along(grid: torch.Tensor, dim: int) -> list[list[int]]:
    """The rank lists of every group along ``dim`` of ``grid`` (in a fixed order)."""
    moved = grid.movedim(dim, -1)
    return moved.reshape(-1, moved.shape[-1]).tolist()


def build_mesh(plan: ParallelPlan, device_type: str = "cpu") -> DeviceMesh:
    """The plan's named mesh over the default group (collective: every rank calls it).

    Checks first that every rank runs this plan (a :class:`RankMismatchError` naming the
    ranks that differ), then makes one group per row of each dimension with the default
    group's timeout.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call dist.init_process_group() (torchrun "
            "sets up the environment) before thinwire.parallelize"
        )
    plan.check_world(dist.get_world_size())
    check_same_plan(plan)
    warn_if_tensor_parallel_spans_hosts(plan)
    return make_mesh(plan, device_type)


def make_mesh(plan: ParallelPlan, device_type: str = "cpu") -> DeviceMesh:
    """The mesh of ``plan`` without the checks (collective): one group per row of each
    dimension, with the default group's timeout."""
    grid = rank_grid(plan)
    rank = dist.get_rank()
    timeout = group_timeout(None)
    mine = []
    for dim in range(len(DIMENSIONS)):
        for ranks in groups_along(grid, dim):
            try:
                group = dist.new_group(ranks=ranks, timeout=timeout)
            except RuntimeError as error:
                raise CommunicationError(
                    f"making the {DIMENSIONS[dim]!r} groups of the plan failed on rank {rank} "
                    f"(timeout {timeout}): every rank must call thinwire.parallelize with the "
                    f"same plan, and no peer may have died. ({error})"
                ) from error
            if rank in ranks:
                mine.append(group)
    return DeviceMesh.from_group(mine, device_type, mesh=grid, mesh_dim_names=DIMENSIONS)


def check_same_plan(plan: ParallelPlan) -> None:
    """Raise :class:`RankMismatchError` on every rank if any rank's plan differs."""
    (differing,) = ranks_differing([plan.describe()], None)
    if differing:
        raise RankMismatchError(
            f"rank {dist.get_rank()} runs the plan {plan}, but rank(s) "
            f"{', '.join(map(str, differing))} run a different one: every rank must pass the "
            "same ParallelPlan to thinwire.parallelize"
        )


def warn_if_tensor_parallel_spans_hosts(plan: ParallelPlan) -> None:
    """Warn when a tensor-parallel group would include ranks of two hosts (torchrun's
    ``LOCAL_WORLD_SIZE`` ranks per host): its collectives run in every layer, forward and
    backward, so they then cross the slow link several times per micro-batch."""
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if plan.tp > 1 and (plan.tp > per_host or per_host % plan.tp):
        warnings.warn(
            f"tensor-parallel groups of {plan.tp} ranks span hosts of {per_host} ranks: "
            f"each layer's all-reduces (4 per block per micro-batch, forward and backward) "
            f"will cross the link between hosts. Prefer tp <= {per_host} (a divisor of it) "
            "and more pipeline or data parallelism",
            stacklevel=3,
        )


def group_across_stages(plan: ParallelPlan, pp_indices: list[int]) -> dist.ProcessGroup | None:
    """For each data- and tensor-parallel coordinate, a group of the ranks at the pipeline
    positions ``pp_indices`` (the holders of a weight two stages share, such as GPT-2's
    tied embedding and head); this rank's group, ``None`` if it is in none. Collective."""
    grid = rank_grid(plan)
    rank, timeout, mine = dist.get_rank(), group_timeout(None), None
    for d in range(plan.dp):
        for t in range(plan.tp):
            ranks = [int(grid[p, d, t]) for p in pp_indices]
            group = dist.new_group(ranks=ranks, timeout=timeout)
            if rank in ranks:
                mine = group
    return mine
