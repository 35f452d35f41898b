"""Synchronise every H steps: DiLoCo and local SGD (``thinwire.DiLoCo``, ``thinwire.LocalSGD``).

    opt = thinwire.DiLoCo(torch.optim.AdamW(model.parameters(), lr=4e-4), model,
                          sync_every=100, compressor="fp16")
    loss.backward(); opt.step(); opt.zero_grad()     # an outer step every 100 steps
    opt.flush()                                      # before evaluation: the ranks agree now

Each rank takes ``sync_every`` (H) steps of its own optimizer (the *inner* one) without
any exchange. Then the ranks average their *pseudo-gradients* (the global weights the
round started from minus the weights they hold now) through a thinwire compressor, and an
*outer* optimizer steps the global weights with that average (DiLoCo, Douillard et al.
2023: SGD with Nesterov momentum, lr 0.7, momentum 0.9). Local SGD is the outer SGD with
lr 1 and no momentum: the new global weights are the ranks' average.

A pseudo-gradient goes through the compressor's error feedback as a gradient does, so what
the compressor leaves out of one outer step is sent in a later one. With ``fragments=F``
the parameters are split into F parts of about equal size that synchronise at evenly
spread steps of each round (streaming DiLoCo: the round's traffic spread over the round);
with ``overlap=T`` each fragment's exchange runs in the background during the next T inner
steps, and when it arrives the fragment's weights become the new global weights plus this
rank's progress of those T steps (nothing counted twice, nothing lost).

The model's floating-point buffers (batch-norm statistics) are averaged, uncompressed, at
the end of each round. Between synchronisations the ranks' weights differ: evaluate or
save the model after :meth:`DiLoCo.flush`, or right after a round ends (:attr:`DiLoCo.synced`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from thinwire.comm.agreement import digest, value_ranges
from thinwire.comm.collectives import Communicator, run_collective
from thinwire.comm.engine import GradientExchange, StepStats
from thinwire.comm.gradients import is_dtensor
from thinwire.comm.replicas import broadcast_where_different
from thinwire.compress.base import Compressor, check_flag, is_integer, is_real
from thinwire.data_parallel.optimizer import (
    DistributedOptimizer,
    StartedExchange,
    check_first_order,
)
from thinwire.data_parallel.parameters import split_parameters
from thinwire.errors import RankMismatchError


@dataclass
class Fragment:
    """A part of the parameters that synchronises on its own: this rank's ``params``, the
    global weights ``anchors`` they started the round from, the ``outer`` optimizer over
    the anchors and the ``exchange`` that averages the anchors' gradients (the
    pseudo-gradients) and steps ``outer``; ``offset``: the step of each round (``step %
    H``) at which it starts its exchange."""

    params: list[tuple[str, nn.Parameter]]
    anchors: list[nn.Parameter]
    outer: torch.optim.SGD
    exchange: DistributedOptimizer
    offset: int
    since_sync: int = 0


@dataclass
class InFlight:
    """A fragment's exchange under way: it is applied after inner step ``due``; ``sent``
    holds the weights its pseudo-gradient was taken from; ``started`` is ``None`` once the
    averages are in the anchors' gradients."""

    fragment: int
    due: int
    sent: list[Tensor]
    started: StartedExchange | None


class DiLoCo:
    """Inner steps on each rank alone; every ``sync_every`` steps an outer step of the
    global weights on the averaged, compressed pseudo-gradient.

    Args:
        optimizer: the inner optimizer over the model's parameters (any first-order one).
        model: the model, or an iterable of ``(name, parameter)`` pairs.
        compressor: the pseudo-gradients' compressor, a registered name or an instance.
        sync_every: H, inner steps per round.
        outer_lr, outer_momentum, nesterov: the outer SGD's settings.
        fragments: F, parts of the parameters synchronised at different steps of a round.
        overlap: T, inner steps a fragment's exchange runs in the background (< H).
        communicator, bucket_cap_mb, fuse_rounds, group, broadcast_parameters: as for
            :class:`~thinwire.DistributedOptimizer`.
        **options: compressor options when ``compressor`` is a name.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Iterable[tuple[str, nn.Parameter]],
        compressor: str | Compressor = "none",
        *,
        sync_every: int = 100,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        fragments: int = 1,
        overlap: int = 0,
        communicator: str | Communicator = "auto",
        bucket_cap_mb: float = 25.0,
        fuse_rounds: bool = True,
        group: dist.ProcessGroup | None = None,
        broadcast_parameters: bool = True,
        **options: Any,
    ) -> None:
        check_first_order(optimizer)
        check_settings(sync_every, outer_lr, outer_momentum, nesterov, fragments, overlap)
        self.optimizer = optimizer
        self.sync_every, self.overlap = int(sync_every), int(overlap)
        self.group = group
        parameters, _ = split_parameters(model)
        parts = split_evenly(parameters, fragments)
        self.fragments: list[Fragment] = []
        for index, part in enumerate(parts):
            anchors = [nn.Parameter(p.detach().clone()) for _, p in part]
            outer = torch.optim.SGD(
                anchors,
                lr=outer_lr,
                momentum=outer_momentum,
                nesterov=nesterov and outer_momentum > 0,
            )
            exchange = DistributedOptimizer(
                outer,
                [(name, a) for (name, _), a in zip(part, anchors, strict=True)],
                compressor,
                communicator=communicator,
                bucket_cap_mb=bucket_cap_mb,
                fuse_rounds=fuse_rounds,
                group=group,
                broadcast_parameters=broadcast_parameters,  # rank 0's weights everywhere
                own_group=overlap > 0,  # background exchanges meet no collective of ours
                **options,
            )
            offset = (index + 1) * self.sync_every // len(parts) % self.sync_every
            self.fragments.append(Fragment(part, anchors, outer, exchange, offset))
        with torch.no_grad():
            for fragment in self.fragments:
                for (_, p), a in zip(fragment.params, fragment.anchors, strict=True):
                    p.copy_(a)
        self._buffers = _floating_buffers(model)
        if broadcast_parameters:
            root = dist.get_global_rank(group, 0) if group else 0
            broadcast_where_different(self._buffers, root, group)
        self._agree(optimizer)
        self.inner_steps = 0
        self._in_flight: collections.deque[InFlight] = collections.deque()

    # -- what the wrapper exposes ---------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups (learning-rate schedulers use these)."""
        return self.optimizer.param_groups

    @property
    def engine(self) -> GradientExchange:
        """The first fragment's exchange engine (the only one without ``fragments``)."""
        return self.fragments[0].exchange.engine

    @property
    def engines(self) -> list[GradientExchange]:
        """Every fragment's exchange engine."""
        return [f.exchange.engine for f in self.fragments]

    @property
    def last_step(self) -> StepStats | None:
        """Statistics of the first fragment's last exchange."""
        return self.engine.last_step

    @property
    def pending(self) -> int:
        """Exchanges under way (started, not yet applied)."""
        return len(self._in_flight)

    @property
    def synced(self) -> bool:
        """Whether every rank holds the same weights now (no local step since each
        fragment's last synchronisation, none under way)."""
        return not self._in_flight and all(f.since_sync == 0 for f in self.fragments)

    # -- training -------------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """One inner step; then apply the exchanges due now and start those of the
        fragments whose turn it is in the round."""
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.inner_steps += 1
        for fragment in self.fragments:
            fragment.since_sync += 1
        while self._in_flight and self._in_flight[0].due <= self.inner_steps:
            self._apply(self._in_flight.popleft())
        if self.inner_steps % self.sync_every == 0:
            # Before the round's last fragment starts: a blocking collective queued behind
            # a fragment on a slow link waits for most of it (measured: about 20 s a round
            # on the image task at 1 Mbit/s, H=50; about 2 s first, on an idle link).
            self._average_buffers()
        for index, fragment in enumerate(self.fragments):
            if self.inner_steps % self.sync_every == fragment.offset:
                self._start(index, self.overlap)
        return loss

    def flush(self) -> None:
        """Apply every exchange under way, then synchronise each fragment that took
        local steps since its last exchange (an outer step on a shorter round): afterwards
        every rank holds the same weights. Collective: every rank calls it at the same
        step."""
        while self._in_flight:
            self._apply(self._in_flight.popleft())
        for index, fragment in enumerate(self.fragments):
            if fragment.since_sync:
                self._start(index, overlap=0)
        self._average_buffers()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (as the inner optimizer does)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """Stop every fragment's exchange thread (after the exchanges under way)."""
        for in_flight in self._in_flight:
            if in_flight.started is not None:
                in_flight.started.future.wait()
        for engine in self.engines:
            engine.close()

    def _start(self, index: int, overlap: int) -> None:
        """Take fragment ``index``'s pseudo-gradients and start averaging them; with
        ``overlap`` 0, apply the result now."""
        fragment = self.fragments[index]
        with torch.no_grad():
            for (_, p), a in zip(fragment.params, fragment.anchors, strict=True):
                a.grad = a.detach() - p.detach()
        sent = [p.detach().clone() for _, p in fragment.params] if overlap else []
        started = fragment.exchange.start_synchronize()
        fragment.since_sync = 0
        in_flight = InFlight(index, self.inner_steps + overlap, sent, started)
        if overlap:
            self._in_flight.append(in_flight)
        else:
            self._apply(in_flight)

    def _apply(self, in_flight: InFlight) -> None:
        """Step the fragment's global weights with the averaged pseudo-gradient and make
        them this rank's weights (plus its progress since the exchange began)."""
        fragment = self.fragments[in_flight.fragment]
        if in_flight.started is not None:
            fragment.exchange.finish_synchronize(in_flight.started)
        fragment.outer.step()
        with torch.no_grad():
            pairs = zip(fragment.params, fragment.anchors, strict=True)
            for i, ((_, p), a) in enumerate(pairs):
                if in_flight.sent:
                    p.sub_(in_flight.sent[i]).add_(a)
                else:
                    p.copy_(a)
                a.grad = None

    def _average_buffers(self) -> None:
        """Average the model's floating-point buffers over the ranks (uncompressed)."""
        size = dist.get_world_size(self.group)
        for name, b in self._buffers:
            run_collective(f"the average of buffer {name!r}", dist.all_reduce, b, group=self.group)
            b.div_(size)

    def _agree(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank must round at the same steps: compare H, F, T and both optimizers'
        settings in one all-reduce; all ranks raise :class:`RankMismatchError` if not."""
        first = self.fragments[0]
        settings = repr(
            [
                (type(o).__name__, [sorted((k, repr(v)) for k, v in g.items() if k != "params")])
                for o in (optimizer, first.outer)
                for g in o.param_groups
            ]
        )
        values = [self.sync_every, len(self.fragments), self.overlap, digest(settings)]
        ranges = value_ranges(values, self.group)
        names = ("sync_every", "fragments", "overlap")
        problems = [
            f"this rank has {name}={value}, the ranks' range from {low} to {high}"
            for name, value, (low, high) in zip(names, values, ranges, strict=False)
            if low != high
        ]
        if ranges[3][0] != ranges[3][1]:
            problems.append("the ranks' inner or outer optimizers differ in class or settings")
        if problems:
            raise RankMismatchError(
                f"ranks disagree (seen from rank {self.engine.rank}): {'; '.join(problems)}. "
                "Every rank must build DiLoCo with the same settings and optimizers."
            )

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self, with_inner: bool = True) -> dict[str, Any]:
        """The inner optimizer's state (this rank's), the global weights, each outer
        optimizer's state, thinwire's (residuals), the step, and the exchanges under way
        (waited for: their averages are stored, so a resume applies them at the same
        step). Collective while exchanges are under way. The model's own weights are this
        rank's: save them per rank, or after :meth:`flush` or at the end of a round.
        ``with_inner=False`` leaves the inner optimizer's state out (for a checkpoint that
        holds it already, as :class:`thinwire.ParallelTrainer`'s does). Tensors sharded
        over a mesh (``DTensor``) are saved as this rank's shard."""
        for in_flight in self._in_flight:
            if in_flight.started is not None:
                self.fragments[in_flight.fragment].exchange.finish_synchronize(in_flight.started)
                in_flight.started = None
        return {
            "settings": self._settings(),
            "inner": self.optimizer.state_dict() if with_inner else None,
            "inner_steps": self.inner_steps,
            "fragments": [
                {
                    "anchors": [_local(a.detach()).clone() for a in f.anchors],
                    "outer": f.outer.state_dict(),
                    "thinwire": f.exchange.engine.state_dict(),
                    "since_sync": f.since_sync,
                }
                for f in self.fragments
            ],
            "in_flight": [
                {
                    "fragment": x.fragment,
                    "due": x.due,
                    "sent": [_local(s).clone() for s in x.sent],
                    "averages": [
                        _local(a.grad).clone() for a in self.fragments[x.fragment].anchors
                    ],
                }
                for x in self._in_flight
            ],
        }

    def load_state_dict(self, state: dict[str, Any], with_inner: bool = True) -> None:
        """Restore what :meth:`state_dict` returned (``with_inner`` as it was saved); a
        state of other settings or other parameters is refused before anything changes."""
        expected = {"settings", "inner", "inner_steps", "fragments", "in_flight"}
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"not a thinwire.DiLoCo state dict (expected keys {sorted(expected)}, got {got})"
            )
        if state["settings"] != self._settings():
            raise ValueError(
                f"this DiLoCo state was saved with {state['settings']}, but this one has "
                f"{self._settings()}: build it with the saved settings to resume"
            )
        for fragment, saved in zip(self.fragments, state["fragments"], strict=True):
            shapes = [tuple(_local(a).shape) for a in fragment.anchors]
            if [tuple(a.shape) for a in saved["anchors"]] != shapes:
                raise ValueError(
                    "this DiLoCo state holds global weights of other shapes than this model's "
                    "parameters: it was saved from another model"
                )
            fragment.exchange.engine.check_state(saved["thinwire"])
        if self._in_flight:
            raise RuntimeError("load a DiLoCo state before training, not with exchanges under way")
        if with_inner:
            self.optimizer.load_state_dict(state["inner"])
        self.inner_steps = int(state["inner_steps"])
        with torch.no_grad():
            for fragment, saved in zip(self.fragments, state["fragments"], strict=True):
                for a, s in zip(fragment.anchors, saved["anchors"], strict=True):
                    _local(a).copy_(s)
                fragment.outer.load_state_dict(saved["outer"])
                fragment.exchange.engine.load_state_dict(saved["thinwire"])
                fragment.since_sync = int(saved["since_sync"])
        for saved in state["in_flight"]:
            fragment = self.fragments[saved["fragment"]]
            sent = []
            for a, (_, p), average, s in zip(
                fragment.anchors, fragment.params, saved["averages"], saved["sent"], strict=True
            ):
                a.grad = torch.zeros_like(a)
                _local(a.grad).copy_(average)
                sent.append(torch.zeros_like(p.detach()))
                _local(sent[-1]).copy_(s)
            self._in_flight.append(InFlight(saved["fragment"], saved["due"], sent, None))

    def _settings(self) -> dict[str, int]:
        """What a checkpoint must agree on to resume."""
        return {
            "sync_every": self.sync_every,
            "fragments": len(self.fragments),
            "overlap": self.overlap,
        }


class LocalSGD(DiLoCo):
    """Local SGD (post-local SGD, periodic averaging): every ``sync_every`` steps the
    ranks' weights are averaged (through ``compressor``, with error feedback). It is
    :class:`DiLoCo` with the outer SGD at lr 1 and no momentum; the other arguments are
    DiLoCo's."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Iterable[tuple[str, nn.Parameter]],
        compressor: str | Compressor = "none",
        *,
        sync_every: int = 100,
        **kwargs: Any,
    ) -> None:
        for fixed in ("outer_lr", "outer_momentum", "nesterov"):
            if fixed in kwargs:
                raise TypeError(
                    f"LocalSGD averages the weights (outer lr 1, no momentum) and takes no "
                    f"{fixed}: use thinwire.DiLoCo to set the outer optimizer"
                )
        super().__init__(
            optimizer,
            model,
            compressor,
            sync_every=sync_every,
            outer_lr=1.0,
            outer_momentum=0.0,
            nesterov=False,
            **kwargs,
        )


def split_evenly(
    parameters: list[tuple[str, nn.Parameter]], parts: int
) -> list[list[tuple[str, nn.Parameter]]]:
    """``parameters`` in order, cut into ``parts`` contiguous runs of about equal numbers
    of values (each at least one parameter): a parameter goes to the part its middle
    value falls in."""
    if parts > len(parameters):
        raise ValueError(
            f"fragments={parts} is more than the model's {len(parameters)} trainable "
            "parameters: use at most that many fragments"
        )
    total = sum(p.numel() for _, p in parameters)
    runs: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(parts)]
    seen = 0
    for position, (name, p) in enumerate(parameters):
        left = len(parameters) - position
        index = min(parts - 1, (2 * seen + p.numel()) * parts // max(2 * total, 1))
        index = max(index, parts - left)  # enough parameters left for the later parts
        while index > 0 and not runs[index - 1]:
            index -= 1  # no part left empty before this one
        runs[index].append((name, p))
        seen += p.numel()
    return runs


def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a ``DTensor``, or ``tensor`` itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _floating_buffers(
    model: nn.Module | Iterable[tuple[str, nn.Parameter]],
) -> list[tuple[str, Tensor]]:
    """``model``'s floating-point buffers (none for ``(name, parameter)`` pairs)."""
    if not isinstance(model, nn.Module):
        return []
    return [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]


def check_settings(
    sync_every: Any, outer_lr: Any, outer_momentum: Any, nesterov: Any, fragments: Any, overlap: Any
) -> None:
    """Refuse settings that cannot run, saying which and what to use."""
    if not is_integer(sync_every) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1 (inner steps), got {sync_every!r}")
    if not is_integer(fragments) or not 1 <= fragments <= sync_every:
        raise ValueError(
            f"fragments must be an integer from 1 to sync_every ({sync_every}), got {fragments!r}"
        )
    if not is_integer(overlap) or not 0 <= overlap < sync_every:
        raise ValueError(
            f"overlap must be an integer >= 0 and below sync_every ({sync_every}): a "
            f"fragment's exchange must arrive before its next one starts; got {overlap!r}"
        )
    if not (is_real(outer_lr) and outer_lr > 0):
        raise ValueError(f"outer_lr must be a number > 0, got {outer_lr!r}")
    if not (is_real(outer_momentum) and 0 <= outer_momentum < 1):
        raise ValueError(f"outer_momentum must be a number in [0, 1), got {outer_momentum!r}")
    check_flag("nesterov", nesterov)
