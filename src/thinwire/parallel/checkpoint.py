"""Checkpoints of a hybrid-parallel run through ``torch.distributed.checkpoint`` (DCP), so a
run saved under one plan resumes under another.

Everything is keyed by the names the unparallelised model gives its parameters:
``model.<name>`` the weights, ``optim.<name>.<key>`` the optimizer's state per parameter
(AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``; SGD's momentum), ``optim.param_groups``
the hyperparameters, ``steps`` the step count. Tensor-parallel shards are saved as
``DTensor``s, so DCP reshards them to whatever plan loads them; a weight pipeline stages or
data-parallel copies hold more than once is written once.

thinwire's own exchange state (error-feedback residuals, PowerSGD's warm start) belongs to
one data-parallel rank of one plan: it is saved per rank, and restored only when the plan
that loads it is the plan that saved it. Under another plan the residuals are dropped with a
warning: they hold one step's unsent gradient, which the next steps' compression error
outweighs anyway.
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from thinwire.errors import CheckpointError
from thinwire.parallel.atomic_save import checkpoint_to_read, describe_failures, save_atomically
from thinwire.parallel.plan import ParallelPlan


def _engine_key() -> str:
    return f"thinwire.rank{dist.get_rank()}"


def collect_state(
    named: Sequence[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    engine: Any,
    plan: ParallelPlan,
    steps: int,
) -> dict[str, Any]:
    """This rank's part of the checkpoint, keyed by the model's names."""
    state: dict[str, Any] = {f"model.{name}": p.detach() for name, p in named}
    for name, p in named:
        for key, value in optimizer.state.get(p, {}).items():
            state[f"optim.{name}.{key}"] = value
    state["optim.param_groups"] = json.dumps(  # one string: DCP would flatten a list
        [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        default=float,  # a tensor learning rate
    )
    state["plan"] = plan.describe()
    state["steps"] = torch.tensor(steps)
    if engine is not None:  # opaque bytes: its residuals appear as training goes
        buffer = io.BytesIO()
        torch.save(engine.state_dict(), buffer)
        buffer.seek(0)
        state[_engine_key()] = buffer
    return state


def save_checkpoint(state: dict[str, Any], path: str | Path) -> None:
    """Write ``state`` (every rank's) to the directory ``path``, atomically: a run killed
    while saving leaves the last checkpoint whole (:mod:`thinwire.parallel.atomic_save`).
    Collective."""
    save_atomically(lambda folder: dcp.save(state, checkpoint_id=folder), path)


def _read(state: dict[str, Any], path: Path) -> None:
    """``dcp.load`` into ``state``; its failure (a ``BaseException``) as a CheckpointError."""
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as error:
        raise CheckpointError(
            f"could not read the checkpoint at {path}: {describe_failures(error)}: it is "
            "damaged, or was written by another version"
        ) from None


def _placeholder(value: Tensor, saved: TensorStorageMetadata) -> Tensor:
    """Where a saved optimizer tensor is read into: shaped like the parameter (and sharded
    like it) when the saved tensor has the parameter's shape, else a plain tensor."""
    if tuple(saved.size) == tuple(value.shape):
        return torch.zeros_like(value)
    return torch.zeros(saved.size, dtype=saved.properties.dtype)


def load_checkpoint(
    path: str | Path,
    named: Sequence[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    engine: Any,
    plan: ParallelPlan,
) -> int:
    """Read the checkpoint at ``path`` into this rank's parameters, optimizer (and, under
    the same plan, exchange engine); the number of steps it had taken. Collective."""
    path = checkpoint_to_read(path)
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except FileNotFoundError:
        raise CheckpointError(
            f"the checkpoint at {path} has no metadata: it is not a checkpoint, or its save "
            "did not finish"
        ) from None
    missing = [name for name, _ in named if f"model.{name}" not in metadata]
    if missing:
        raise ValueError(
            f"the checkpoint at {path} has no weights for {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}: it was saved from another model"
        )
    state: dict[str, Any] = {f"model.{name}": p.detach() for name, p in named}
    slots: list[tuple[nn.Parameter, str, str]] = []
    for name, p in named:
        prefix = f"optim.{name}."
        for key, saved in metadata.items():
            if key.startswith(prefix) and isinstance(saved, TensorStorageMetadata):
                state[key] = _placeholder(p, saved)
                slots.append((p, key[len(prefix) :], key))
    state.update({"optim.param_groups": None, "plan": None, "steps": torch.tensor(0)})
    same_plan = engine is not None and _engine_key() in metadata
    probe: dict[str, Any] = {"plan": None}
    _read(probe, path)
    same_plan = same_plan and probe["plan"] == plan.describe()
    if same_plan:
        state[_engine_key()] = io.BytesIO()
    _read(state, path)
    for p, key, full_key in slots:
        optimizer.state[p][key] = state[full_key]
    groups = json.loads(state["optim.param_groups"])
    if len(groups) == len(optimizer.param_groups):
        for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
            for key, value in saved_group.items():
                if isinstance(group.get(key), torch.Tensor):
                    group[key].fill_(value)
                else:
                    group[key] = tuple(value) if isinstance(value, list) else value
    if engine is not None:
        if same_plan:
            buffer = state[_engine_key()]
            buffer.seek(0)
            engine.load_state_dict(torch.load(buffer, weights_only=True))
        else:
            warnings.warn(
                f"the checkpoint at {path} was saved under another plan ({state['plan']}); "
                "thinwire's error-feedback state (one step's unsent gradient per rank) is "
                "dropped, the weights and optimizer state are resharded",
                stacklevel=3,
            )
    return int(state["steps"])
