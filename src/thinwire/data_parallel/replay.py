"""Consensus and replay: delayed averaging that is exact for any optimizer.

:class:`~thinwire.DelayedAveraging` corrects SGD (plain, or heavy-ball momentum) in closed
form, because its step is linear in the gradient. Adam's is not (nor RMSprop's, nor
Nesterov momentum's), and a plain-SGD correction of ``lr * (avg - own)`` cannot undo an
Adam step: each rank would keep its own updates and the ranks would drift apart. For those
optimizers each rank keeps what all ranks agree on and rebuilds its own weights from it.
With ``opt_step(w, S, g; h)`` the optimizer's step from weights ``w`` and state ``S`` (the
moments, the step count) on gradient ``g`` with hyperparameters ``h`` (learning rate, ...)
as they were at that step::

    consensus:  (w_c, S_c) <- opt_step(w_c, S_c, avg_s; h_s)     when avg_s arrives (s = t - D)
    own:        (w, S)     <- (w_c, S_c), then for r = s+1 .. t:  opt_step(w, S, g_r^i; h_r)

``w_c`` and ``S_c`` see nothing but averages, so every rank holds the same (bit for bit:
same inputs, same operations); a rank's own weights are the consensus plus its last D local
steps, and after a flush they are the consensus. This is the synchronous optimizer run on
the averaged gradients, each of which was computed on weights D steps ahead of it. The
cost: one copy of the weights and of the optimizer's state, and D + 1 optimizer steps
per training step instead of one (on the fashion ResNet-18, 2.8 M parameters, one CPU
thread: 54-63 ms for D = 1 against Adam's own 24 ms, 125-148 ms for D = 4;
``bench/replay_cost.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from copy import deepcopy
from typing import Any

import torch
from torch import Tensor

#: a parameter group's settings, ``params`` left out: ``lr``, ``betas``, ``weight_decay``...
Hyper = list[dict[str, Any]]


def hyperparameters(optimizer: torch.optim.Optimizer) -> Hyper:
    """Every parameter group's settings as they are now (what a step will use); tensor
    settings are copied, since schedulers update a tensor learning rate in place."""
    return [
        {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in group.items()}
        for group in ({k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups)
    ]


class ConsensusReplay:
    """A second instance of ``optimizer``'s class over copies of its parameters: the
    consensus, stepped on averaged gradients only; and the replay of a rank's own recent
    steps on top of it (see the module doc). The live weights are rebuilt at every step:
    a change made to them outside the optimizer while steps are pending (clipping the
    weights, a projection) is undone, and the optimizer's step hooks (and a scheduler's
    count of its steps) see D + 1 steps per training step.

    Raises:
        TypeError: the optimizer's class cannot be built again from its parameter groups
            (a custom optimizer whose constructor needs more than ``params`` and settings).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.live = [p for group in optimizer.param_groups for p in group["params"]]
        self.group_sizes = group_sizes(optimizer)
        self.copies = [p.detach().clone() for p in self.live]
        groups, start = [], 0
        for group, hyper in zip(optimizer.param_groups, hyperparameters(optimizer), strict=True):
            end = start + len(group["params"])
            groups.append({**hyper, "params": self.copies[start:end]})
            start = end
        try:
            self.consensus = type(optimizer)(groups)
        except TypeError as error:
            raise TypeError(
                f"DelayedAveraging keeps the agreed weights with a second "
                f"{type(optimizer).__name__} over copies of the parameters, but building one "
                f"from the parameter groups failed ({error}). Use an optimizer whose "
                "constructor takes its parameter groups alone (every torch.optim one does)."
            ) from error

    def check_unchanged(self) -> None:
        """Refuse parameter groups added or changed since construction (the consensus
        would not step them)."""
        refuse_changed_groups(self.optimizer, self.group_sizes)

    def adopt_live(self) -> None:
        """Make the consensus what the live weights and state are now (at the start, and
        after a checkpoint was loaded into the model or the optimizer)."""
        with torch.no_grad():
            for copy, p in zip(self.copies, self.live, strict=True):
                copy.copy_(p)
        _copy_state(self.optimizer, self.live, self.consensus, self.copies)

    def advance(self, averages: Mapping[int, Tensor], hyper: Hyper) -> None:
        """One consensus step on the averaged gradients (keyed by ``id`` of the live
        parameter; a parameter without one takes no step) with the settings ``hyper``."""
        for copy, p in zip(self.copies, self.live, strict=True):
            average = averages.get(id(p))
            copy.grad = None if average is None else average.to(copy.dtype)
        _set_hyperparameters(self.consensus, hyper)
        self.consensus.step()
        for copy in self.copies:
            copy.grad = None

    def rebuild(self, own_steps: Sequence[tuple[Mapping[int, Tensor], Hyper]]) -> None:
        """Set the live weights and state to the consensus, then take this rank's own
        steps on it again, oldest first; each rank's gradients are left as they were."""
        kept = [p.grad for p in self.live]
        with torch.no_grad():
            for p, copy in zip(self.live, self.copies, strict=True):
                p.copy_(copy)
        _copy_state(self.consensus, self.copies, self.optimizer, self.live)
        for grads, hyper in own_steps:
            for p in self.live:
                p.grad = grads.get(id(p))
            _set_hyperparameters(self.optimizer, hyper)
            self.optimizer.step()
        for p, grad in zip(self.live, kept, strict=True):
            p.grad = grad


def _set_hyperparameters(optimizer: torch.optim.Optimizer, hyper: Hyper) -> None:
    """Give ``optimizer``'s groups the settings ``hyper`` (a tensor setting is copied into
    the group's own tensor, which a scheduler may hold)."""
    for group, settings in zip(optimizer.param_groups, hyper, strict=True):
        for key, value in settings.items():
            held = group.get(key)
            if isinstance(value, Tensor) and isinstance(held, Tensor) and held.shape == value.shape:
                with torch.no_grad():
                    held.copy_(value)
            else:
                group[key] = value


def _copy_state(
    source: torch.optim.Optimizer,
    source_params: Sequence[Tensor],
    target: torch.optim.Optimizer,
    target_params: Sequence[Tensor],
) -> None:
    """``target``'s per-parameter state becomes a copy of ``source``'s (tensors copied in
    place where they fit, so steady-state steps allocate nothing)."""
    for src, dst in zip(source_params, target_params, strict=True):
        _copy_entry(source.state.get(src), target, dst)


@torch.no_grad()
def _copy_entry(state: dict[str, Any] | None, target: torch.optim.Optimizer, dst: Tensor) -> None:
    """Make ``target.state[dst]`` a copy of ``state`` (none: no state)."""
    if not state:
        target.state.pop(dst, None)
        return
    copied = target.state[dst]
    for key in [k for k in copied if k not in state]:
        del copied[key]
    for key, value in state.items():
        held = copied.get(key)
        if not isinstance(value, Tensor):
            copied[key] = deepcopy(value)
        elif (
            isinstance(held, Tensor)
            and held.shape == value.shape
            and held.dtype == value.dtype
            and held.device == value.device
        ):
            held.copy_(value)
        else:
            copied[key] = value.detach().clone()


def group_sizes(optimizer: torch.optim.Optimizer) -> list[int]:
    """How many parameters each of ``optimizer``'s groups has."""
    return [len(group["params"]) for group in optimizer.param_groups]


def refuse_changed_groups(optimizer: torch.optim.Optimizer, sizes: list[int]) -> None:
    """Raise ``ValueError`` if ``optimizer``'s groups no longer have ``sizes`` parameters:
    DelayedAveraging corrects (or replays) the parameters it was built with, and would
    leave a group added since on each rank's own gradients."""
    now = group_sizes(optimizer)
    if now != sizes:
        raise ValueError(
            f"the optimizer's parameter groups changed (parameters per group: {sizes} at "
            f"construction, {now} now), but DelayedAveraging corrects only the parameters "
            "it was built with: build DelayedAveraging after add_param_group()"
        )
