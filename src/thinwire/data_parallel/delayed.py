"""Delayed Gradient Averaging (Zhu et al. 2021): step on the local gradient now, correct later.

    opt = thinwire.DelayedAveraging(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model, "fp16", delay=2)
    loss.backward(); opt.step(); opt.zero_grad()
    ...
    opt.flush()    # before evaluation or a checkpoint: apply every pending correction

Each ``step()`` starts the exchange of this rank's gradients on the engine's exchange
thread and returns without waiting for it; the averaged gradient arrives ``delay`` steps
later, so communication overlaps ``delay`` steps of compute. The cost: weights differ
between ranks by their last ``delay`` local gradients, training sees gradients averaged
``delay`` steps late, and each rank keeps ``delay`` fp32 copies of the gradients. Errors of
an exchange (a dead peer, a non-finite gradient) surface when it is waited for: up to
``delay`` steps later, or in :meth:`DelayedAveraging.flush`.

This module holds :class:`DelayedAveraging`; its parts live beside it: the closed-form SGD
correction in :mod:`~thinwire.data_parallel.delayed_correction`, the lanes and pending
steps in :mod:`~thinwire.data_parallel.delayed_lanes`, the agreement and finiteness checks
in :mod:`~thinwire.data_parallel.delayed_checks`, and the consensus replay for other
optimizers in :mod:`~thinwire.data_parallel.replay`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from thinwire.comm.collectives import Communicator
from thinwire.comm.engine import GradientExchange, GradientItem, StepStats
from thinwire.comm.gradients import gradient_of
from thinwire.compress.base import Compressor, Memory, is_integer
from thinwire.data_parallel.delayed_checks import agree_on_settings, refuse_non_finite
from thinwire.data_parallel.delayed_correction import (
    closed_form,
    correction_coefficients,
    exact_momentum,
)
from thinwire.data_parallel.delayed_lanes import Pending, extra_lanes, wait_exchange
from thinwire.data_parallel.optimizer import DistributedOptimizer
from thinwire.data_parallel.replay import (
    ConsensusReplay,
    group_sizes,
    hyperparameters,
    refuse_changed_groups,
)


class DelayedAveraging:
    """Data-parallel training with gradients averaged ``delay`` steps late, then corrected.

    With ``g_t^i`` rank i's gradient at step t, ``avg_t = (1/N) sum_i g_t^i`` as the
    compressor delivers it (identical on every rank), ``lr_t`` the learning rate of the
    parameter's group at step t and ``D = delay``::

        D = 0:  w <- optimizer_step(w, avg_t)                   synchronous data parallel
        D > 0:  w <- optimizer_step(w, g_t^i)                   exchange of g_t^i starts
                w <- w - lr_{t-D} * (avg_{t-D} - g_{t-D}^i)     if t >= D (D steps late)

    With plain SGD this gives, after step t (and after :meth:`flush`, with no own term)::

        w_{t+1}^i = w_0 - sum_{s <= t-D} lr_s avg_s - sum_{t-D < s <= t} lr_s g_s^i

    so every rank agrees on everything older than D steps. The correction uses the rate
    that applied ``g_{t-D}`` locally, so a learning-rate schedule leaves no own-gradient
    residue. ``D = 0`` is exactly :class:`~thinwire.DistributedOptimizer` (same code).

    With SGD momentum ``m`` (heavy ball, no dampening, no Nesterov) and weight decay
    ``wd`` the correction also replays what the missing ``delta = avg - own`` would have
    done through the momentum buffer and the decay: SGD's step is affine in the gradient,
    the weights and the buffer, so ``delta`` at step t moves them by ``a * delta`` and
    ``b * delta`` after the local steps ``t .. t+j``, with ``a`` and ``b`` from
    :func:`correction_coefficients` (without decay and with a constant momentum
    ``a = -sum_k lr_{t+k} m^k`` and ``b = m^j``; a schedule that changes the momentum, as
    OneCycleLR does, is followed step by step). Once every correction is in (after
    :meth:`flush`) each rank has applied exactly the averaged gradients, through the same
    momentum and decay: the ranks hold the same weights and buffers, up to rounding. DGC
    applies its momentum in its memory, before the exchange, so it is exact as well.

    Other optimizers (Adam, AdamW, RMSprop, SGD with Nesterov momentum or dampening) have
    no closed-form correction: their step is not linear in the gradient. For them each rank
    keeps the consensus, a second instance of the optimizer over copies of the weights
    that steps on the averaged gradients only, and rebuilds its own weights every step as
    the consensus plus its last D local steps replayed (:mod:`thinwire.data_parallel.replay`). After
    :meth:`flush` every rank holds the consensus: the same weights and optimizer state.
    This costs a copy of the weights and of the optimizer state, one of each pending
    step's gradients, and D + 1 optimizer steps per training step; and the weights are
    rebuilt at every step, so edits made to them outside the optimizer (weight clipping)
    are undone, and step hooks run D + 1 times. Parameters the optimizer steps but
    ``model`` leaves out are not averaged: their own gradients stand for the average.

    Args:
        optimizer: the local optimizer over the model's parameters.
        model: the model, or an iterable of ``(name, parameter)`` pairs.
        compressor: a registered name or a :class:`Compressor` instance; it compresses the
            delayed exchange, with error feedback, as in ``DistributedOptimizer``.
        delay: D, an integer >= 0: how many steps an exchange has to finish.
        lanes: how many steps' exchanges may be in flight at once, each on a process group
            of its own (1: one after another). On a high-latency link one exchange spends
            most of its time waiting, so ``lanes = D`` lets D of them share the link. Only
            for exchanges without state between steps (compressors ``none``, ``fp16``,
            ``bf16`` without error feedback); others must run in order.
        communicator: ``"auto"``, ``"allreduce"``, ``"allgather"`` or ``"direct"``.
        memory: override the compressor's default error-feedback memory.
        bucket_cap_mb: gradients are exchanged in buckets of about this size.
        fuse_rounds: send each bucket's later rounds in the collectives of the next
            bucket's first, as ``DistributedOptimizer`` does (``False``: each bucket's
            rounds alone).
        group: the process group; default: the global one. The exchanges run on a new
            process group of the same ranks, so the program's own collectives on
            ``group`` between steps (a logged loss) cannot meet them.
        broadcast_parameters: copy rank 0's parameters to every rank at construction (the
            ranks compare digests first; only tensors that differ somewhere travel).
        **options: compressor options when ``compressor`` is a name.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Iterable[tuple[str, nn.Parameter]],
        compressor: str | Compressor = "none",
        *,
        delay: int = 1,
        lanes: int = 1,
        communicator: str | Communicator = "auto",
        memory: Memory | None = None,
        bucket_cap_mb: float = 25.0,
        fuse_rounds: bool = True,
        group: dist.ProcessGroup | None = None,
        broadcast_parameters: bool = True,
        **options: Any,
    ) -> None:
        if not is_integer(delay) or delay < 0:
            raise ValueError(f"delay must be an integer >= 0 (steps), got {delay!r}")
        if not is_integer(lanes) or lanes < 1:
            raise ValueError(f"lanes must be an integer >= 1, got {lanes!r}")
        delay, lanes = int(delay), int(lanes)
        # The synchronous wrapper validates the options, checks that every rank has the
        # same parameters and compressor, broadcasts rank 0's weights and makes the
        # buckets; D = 0 is its step, and D > 0 reuses its engine and buckets. The
        # exchanges run on a process group of their own: with D > 0 they run in the
        # background between steps, and the program's collectives on ``group`` (a logged
        # loss, a second wrapper) would otherwise interleave with them.
        self._sync = DistributedOptimizer(
            optimizer,
            model,
            compressor,
            communicator=communicator,
            memory=memory,
            bucket_cap_mb=bucket_cap_mb,
            fuse_rounds=fuse_rounds,
            group=group,
            broadcast_parameters=broadcast_parameters,
            own_group=True,  # also for D = 0: ranks disagreeing on D must not hang here
            **options,
        )
        self._delay = delay
        agree_on_settings(self.engine, delay, lanes, optimizer)
        self._lanes = [self.engine, *extra_lanes(self.engine, lanes, group)]
        self._started = 0  # steps whose exchange has been started
        #: per group, (learning rate, weight decay, momentum) of the last D + 1 local steps
        self._rate_history: collections.deque[list[tuple[float, float, float]]] = collections.deque(
            maxlen=delay + 1
        )
        self._momenta = [exact_momentum(optimizer, group) for group in optimizer.param_groups]
        in_closed_form = all(closed_form(optimizer, group) for group in optimizer.param_groups)
        #: the consensus of optimizers without a closed-form correction (Adam, ...)
        self._replay = ConsensusReplay(optimizer) if delay > 0 and not in_closed_form else None
        self._group_sizes = group_sizes(optimizer)
        self._group_of = {
            id(p): index
            for index, param_group in enumerate(optimizer.param_groups)
            for p in param_group["params"]
        }
        # DGC's memory reads the weights (weight decay) on the exchange thread, while
        # the local step writes them: give it a copy taken before the step.
        self._snapshot_params = bool(getattr(self.engine.memory, "weight_decay", 0))
        self._pending: collections.deque[Pending] = collections.deque()

    # -- what the wrapper exposes -------------------------------------------------------

    @property
    def delay(self) -> int:
        """D: the number of steps between an exchange's start and its correction."""
        return self._delay

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped (local) optimizer."""
        return self._sync.optimizer

    @property
    def engine(self) -> GradientExchange:
        """The exchange engine: compressor, memory, statistics, step counter."""
        return self._sync.engine

    @property
    def parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The ``(name, parameter)`` pairs whose gradients are averaged."""
        return self._sync.parameters

    @property
    def buckets(self) -> list[list[tuple[str, nn.Parameter]]]:
        """The exchange buckets, last parameters first."""
        return self._sync.buckets

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (learning-rate schedulers use these)."""
        return self.optimizer.param_groups

    @property
    def last_step(self) -> StepStats | None:
        """Statistics of the last finished exchange (with D > 0, possibly an older step)."""
        return self.engine.last_step

    @property
    def pending(self) -> int:
        """How many steps' corrections are still outstanding (at most D between steps)."""
        return len(self._pending)

    # -- training -----------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Evaluate ``closure`` (if any), start this step's exchange, take the local step,
        then apply the correction of the exchange started D steps ago."""
        if self._delay == 0:
            return self._sync.step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._replay is not None:
            self._replay_step(self._replay)
            return loss
        refuse_changed_groups(self.optimizer, self._group_sizes)
        self._pending.append(self._start_exchange())
        refuse_non_finite(self.buckets, self._pending[-1].step, self.engine.rank)
        self.optimizer.step()
        self._rate_history.append(self._pending[-1].rates)
        while len(self._pending) > self._delay:
            self._correct(self._pending.popleft())
        return loss

    def _replay_step(self, replay: ConsensusReplay) -> None:
        """Without a closed-form correction: advance the consensus by every average that is
        due, then rebuild this rank's weights as the consensus plus its pending own steps
        (just the local step if no average was due)."""
        replay.check_unchanged()
        if not self._pending:  # the weights are agreed (start, flush, a loaded checkpoint)
            replay.adopt_live()
        self._pending.append(self._start_exchange())
        refuse_non_finite(self.buckets, self._pending[-1].step, self.engine.rank)
        if len(self._pending) <= self._delay:
            self.optimizer.step()
            return
        self._advance_consensus(replay, keep=self._delay)
        replay.rebuild([(pending.own or {}, pending.hyper or []) for pending in self._pending])

    def _advance_consensus(self, replay: ConsensusReplay, keep: int) -> None:
        """Step the consensus on the averages of the oldest pending steps, until ``keep``
        steps are pending."""
        while len(self._pending) > keep:
            oldest = self._pending.popleft()
            replay.advance(self._averages(oldest), oldest.hyper or [])

    def _averages(self, pending: Pending) -> dict[int, Tensor]:
        """Wait for one step's exchange: its averaged gradients by parameter id; a
        parameter that is not averaged (the optimizer has it, ``model`` does not) keeps
        this rank's own gradient, as in ``DistributedOptimizer``."""
        averages = dict(pending.own or {})
        for bucket, means, future in zip(
            self.buckets, pending.deltas, pending.futures, strict=True
        ):
            wait_exchange(future)  # raises the exchange's error (CommunicationError, ...) here
            for (_, p), mean in zip(bucket, means, strict=True):
                averages[id(p)] = mean
        return averages

    def flush(self) -> None:
        """Wait for every exchange in flight and apply its correction, oldest first; ranks
        then hold the same weights. Call before evaluation and checkpoints. It waits for
        this rank's exchanges only, so one rank may flush alone; but every rank must have
        called step() as many times, or the one with more waits out the timeout."""
        if self._replay is not None:
            if self._pending:
                self._advance_consensus(self._replay, keep=0)
                self._replay.rebuild([])
            return
        while self._pending:
            self._correct(self._pending.popleft())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (as the wrapped optimizer does)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def lanes(self) -> int:
        """How many exchanges may be in flight at once."""
        return len(self._lanes)

    def _start_exchange(self) -> Pending:
        """Copy this rank's gradients (fp32) and queue their exchange, all buckets in one
        job on the lane's exchange thread. Parameters without a gradient get zeros, as in
        ``DistributedOptimizer``, so every rank issues the same collectives and steps the
        same parameters."""
        self._sync.check_requires_grad_unchanged()
        rates = self._step_rates()  # before any exchange starts: it may refuse the step
        buckets: list[list[GradientItem]] = []
        engine = self._lanes[self._started % len(self._lanes)]
        with torch.no_grad():
            for bucket in self.buckets:
                items = []
                for name, p in bucket:
                    own = gradient_of(name, p).detach().to(torch.float32, copy=True)
                    param = p.detach().clone() if self._snapshot_params else None
                    items.append(GradientItem(name, own, param))
                buckets.append(items)
        futures = [torch.futures.Future() for _ in buckets]
        engine.submit(partial(self._exchange, engine, buckets, futures))
        self._started += 1
        deltas = [[item.grad for item in items] for items in buckets]
        pending = Pending(deltas, futures, rates, step=self._started - 1)
        if self._replay is not None:
            pending.own = {
                id(p): p.grad.detach().clone() for p in self._replay.live if p.grad is not None
            }
            pending.hyper = hyperparameters(self.optimizer)
        return pending

    def _exchange(
        self,
        engine: GradientExchange,
        buckets: list[list[GradientItem]],
        futures: list[torch.futures.Future],
    ) -> None:
        """On the exchange thread: average one step's buckets, in order, and turn each own
        gradient into ``avg - own`` in place (into ``avg`` when replaying: some compressors
        reuse their output buffers next step, and the exchange never writes its input);
        resolve each bucket's future as it finishes. With ``fuse_rounds``, bucket i's later
        rounds travel in bucket i+1's collectives (:meth:`GradientExchange.exchange_fused`).
        An error fails every bucket not yet finished, so :meth:`_correct` raises it instead
        of waiting."""
        try:
            for index, items in enumerate(buckets):
                last = index == len(buckets) - 1
                # the last bucket closes the step before anyone waiting on it wakes up
                finished = engine.exchange_bucket(
                    items, index, last=last, fuse=self._sync.fuse_rounds
                )
                for done, means in finished:
                    for item, mean in zip(buckets[done], means, strict=True):
                        if self._replay is not None:
                            item.grad.copy_(mean)
                        else:
                            item.grad.neg_().add_(mean)
                for done, _ in finished:
                    futures[done].set_result(None)
        except BaseException as error:
            for future in futures:
                if not future.done():
                    future.set_exception(error)
            raise

    def _step_rates(self) -> list[tuple[float, float, float]]:
        """Each group's (learning rate, weight decay, momentum) for the local step about to
        be taken. Schedules may change all three (OneCycleLR cycles the momentum), but a
        group's momentum may not switch on or off: SGD then creates or drops its buffer,
        which the closed-form correction cannot follow."""
        rates = []
        for index, param_group in enumerate(self.optimizer.param_groups):
            momentum = exact_momentum(self.optimizer, param_group)
            if bool(momentum) != bool(self._momenta[index]):
                raise ValueError(
                    f"DelayedAveraging: parameter group {index}'s momentum is {momentum:g} now "
                    f"but was {self._momenta[index]:g} when it was built; a schedule may "
                    "change a momentum between non-zero values, not switch it on or off. "
                    "Build the optimizer with the momentum setting the whole run uses."
                )
            rates.append(
                (
                    float(param_group["lr"]),
                    float(param_group.get("weight_decay", 0.0)),
                    momentum,
                )
            )
        return rates

    def _correct(self, pending: Pending) -> None:
        """Wait for one step's exchange and apply ``delta = avg - own`` as if step t had
        used the average: after the local steps t .. t+j, with each group's momentum and
        the rates those steps used (:func:`correction_coefficients`)::

            w   += delta * a      (what delta would have moved the weights by)
            buf += delta * b      (what it would still carry in the momentum buffer)
        """
        taken = self._started - pending.step  # local steps t .. t+j: j + 1 of them
        recent = list(self._rate_history)[-taken:]
        scales, carries = [], []
        for index, momentum in enumerate(self._momenta):
            moved, carried = correction_coefficients([rates[index] for rates in recent])
            scales.append(moved)
            carries.append(carried if momentum else 0.0)
        for bucket, deltas, future in zip(
            self.buckets, pending.deltas, pending.futures, strict=True
        ):
            wait_exchange(future)  # raises the exchange's error (CommunicationError, ...) here
            with torch.no_grad():
                for (_, p), delta in zip(bucket, deltas, strict=True):
                    index = self._group_of.get(id(p))
                    if index is None:  # averaged, but no optimizer group steps it
                        continue
                    p.add_(delta.to(p.dtype), alpha=scales[index])
                    if carries[index]:
                        buffer = self.optimizer.state[p].get("momentum_buffer")
                        if buffer is not None:
                            buffer.add_(delta.to(buffer.dtype), alpha=carries[index])

    # -- checkpointing ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state and thinwire's, as ``DistributedOptimizer`` saves
        them (interchangeable). Refused while corrections are pending: call :meth:`flush`
        first, and save the model after it too."""
        self._refuse_while_pending("state_dict")
        return self._sync.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (no corrections may be pending)."""
        self._refuse_while_pending("load_state_dict")
        self._sync.load_state_dict(state)

    def _refuse_while_pending(self, what: str) -> None:
        if self._pending:
            raise RuntimeError(
                f"DelayedAveraging.{what}() with {len(self._pending)} step(s) of corrections "
                f"pending (delay={self._delay}): the weights are not yet the agreed ones. "
                "Call flush() first (on every rank), then save or load model and optimizer."
            )
