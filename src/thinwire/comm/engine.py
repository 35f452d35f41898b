"""The gradient exchange engine: memory -> compressor -> communicator -> averaged gradient.

``GradientExchange`` averages a group of gradient tensors (a DDP bucket, or a bucket of the
optimizer wrapper) over the ranks. For every tensor it compensates with the error-feedback
memory, starts the compressor's exchange protocol (or the dense one for tensors the
compressor declines), then drives all protocols in lock-step: each round's requests go to
the communicator together, one collective per kind (with :meth:`exchange_fused`, with the
next rounds of the buckets before it). The memory keeps what was not sent; the engine keeps
the step, statistics and checkpoint state, and owns the exchange thread.

A rank whose gradients are not finite poisons its first round, so every rank learns of it
from the same collective, and the step is refused on every rank: the memory and the
compressor go back to where they were before it. On the CPU each round's verdict is read
at once; on a GPU (:attr:`GradientExchange.defer_verdicts`) they stay device flags until
the step's last exchange reads them all in one wait: one host wait per step, or none
where a fused optimizer skips the step on the device (:mod:`thinwire.comm.device_refusal`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from thinwire.comm.agreement import parameter_layout, ranks_differing
from thinwire.comm.batch import Batch, GradientItem
from thinwire.comm.checkpoint import (
    check_owner,
    check_same_start,
    gather_states,
    is_all_ranks,
    own_part,
    owner_of,
)
from thinwire.comm.collectives import Communicator, make_communicator
from thinwire.comm.device_refusal import DeviceRefusal
from thinwire.comm.runs import (
    Means,
    arrange_memory,
    bucket_means,
    plan_runs,
    start_run,
    sums_show,
    update_memory,
)
from thinwire.comm.saved_options import option_defaults
from thinwire.comm.step_stats import StepStats
from thinwire.comm.survey import Surveys
from thinwire.comm.verdicts import non_finite_message
from thinwire.comm.worker import OrderedWorker
from thinwire.compress.base import Compressor, Memory
from thinwire.compress.feedback import NoMemory, memory_for
from thinwire.compress.finite import FiniteChecks
from thinwire.compress.none import NoCompression
from thinwire.compress.registry import compressor as build_compressor
from thinwire.errors import NonFiniteGradientError, RankMismatchError


class GradientExchange:
    """Averages gradients over a process group through a compressor.

    Args:
        compressor: a :class:`~thinwire.compress.base.Compressor` or a registered name.
        communicator: ``"auto"`` (all-reduce for summable payloads, all-gather otherwise),
            ``"allreduce"``, ``"allgather"``, ``"direct"`` (all-gather in one step, for
            long round trips) or a communicator instance.
        memory: the error-feedback memory; default: the compressor's own choice.
        group: the process group; default: the global one.
        history: how many steps of :class:`StepStats` to keep.
    """

    def __init__(
        self,
        compressor: str | Compressor = "none",
        *,
        communicator: str | Communicator = "auto",
        memory: Memory | None = None,
        group: dist.ProcessGroup | None = None,
        history: int = 10_000,
    ) -> None:
        self.compressor = build_compressor(compressor)
        self.communicator = make_communicator(communicator, self.compressor, group)
        self.memory = memory_for(self.compressor, memory)
        self.dense = NoCompression()
        self._surveys = Surveys(self.compressor)
        self.step = 0
        self.history: collections.deque[StepStats] = collections.deque(maxlen=history)
        self._current = StepStats(step=0)
        self._worker: OrderedWorker | None = None
        self._in_flight: list[Batch] = []
        #: the compressor's state before the step under way, to restore if it is refused
        self._before_step: dict[str, Any] | None = None
        #: the all-ranks checkpoint this exchange resumed from (0: none), and whether the
        #: ranks have checked that they all start from the same one (at the first exchange)
        self._origin = 0
        self._start_checked = not self.communicator.checks_start
        #: read finiteness verdicts once per step rather than once per round: ``None``
        #: wherever the gradients are not on the CPU (a read makes the host wait for the
        #: GPU), ``True`` everywhere (tests), ``False`` nowhere
        self.defer_verdicts: bool | None = None
        #: the step's verdicts not read yet (device flags), and the batches they cover
        self._verdicts: list[Tensor] = []
        self._suspects: list[Batch] = []
        #: refuses a lazy step on the device instead (``register`` and the optimizer
        #: wrapper set it for a fused optimizer, where the memory and the compressor can
        #: undo a step there: :func:`~thinwire.comm.device_refusal.device_refusal`)
        self.device_refusal: DeviceRefusal | None = None
        #: per DDP bucket, its last exchange's order (saved: a resumed first step keeps it)
        self.bucket_orders: dict[int, list[str]] = {}
        self.restored_bucket_orders: dict[int, list[str]] = {}

    # -- running exchanges ----------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks gradients are averaged over."""
        return self.communicator.world_size

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self.communicator.rank

    def submit(self, job: Any, here: bool = False) -> torch.futures.Future:
        """Run ``job`` on the exchange thread (``here``: on this thread, once that one is
        idle), after every job submitted before it (:meth:`OrderedWorker.submit`)."""
        if self._worker is None or self._worker.closed:  # closed: its group was destroyed
            self._worker = OrderedWorker(group=getattr(self.communicator, "group", None))
        return self._worker.submit(job, here)

    def exchange_bucket(
        self,
        items: Sequence[GradientItem],
        token: Any = None,
        *,
        last: bool,
        fuse: bool = False,
        step: int | None = None,
        whole: Tensor | None = None,
    ) -> list[tuple[Any, Means]]:
        """The one entry point for a step's buckets: compensate, exchange and finish
        ``items`` (with ``fuse``, its later rounds travel with the next bucket's first, as
        :meth:`exchange_fused` does), and with ``last`` close the step (:meth:`end_step`:
        statistics, counter, the memory's commit) before returning. A failure rolls the
        step back on every rank and raises. ``step``: the step these gradients belong to,
        where the caller keeps the clock (a parameter server applies pushes of several
        steps); the first bucket of a step takes it. Returns ``(token, means)`` for each
        bucket this call finished, oldest first; every rank must make the same calls.
        ``whole``: the gradients side by side in one flat tensor, where the caller has
        them so (a DDP bucket's buffer): the exchange then need not look for it."""
        if step is not None:
            self._take_step(step)
        if fuse:
            finished = self.exchange_fused(items, token, last=last, whole=whole)
        else:
            finished = [(token, self.exchange(items, whole=whole))]
        if last:
            self.end_step()
        return finished

    def _take_step(self, step: int) -> None:
        """Number the step under way ``step`` (only between steps)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if self._before_step is None and not self._in_flight:
            self.step, self._current = step, StepStats(step=step)
        elif step != self.step:
            raise RuntimeError(
                f"a step's buckets must share its step number: this step is {self.step}, and "
                f"a bucket of it came with step {step}"
            )

    def exchange(self, items: Sequence[GradientItem], whole: Tensor | None = None) -> Means:
        """Average ``items``' gradients over all ranks (blocking); returns the means in the
        gradients' dtypes. Every rank must call this with the same keys and shapes."""
        started, communicated = time.perf_counter(), 0.0
        try:
            batch = self._start(items, whole=whole)
            first = True
            while not batch.done:
                communicated += self._round([batch], fresh=batch if first else None)
                first = False
            self._settle()
            means = self._finish(batch)
        except BaseException:
            self._drop_step()
            raise
        self._account(started, communicated)
        return means

    def exchange_fused(
        self,
        items: Sequence[GradientItem],
        token: Any,
        last: bool,
        whole: Tensor | None = None,
    ) -> list[tuple[Any, Means]]:
        """Start ``items``' exchange and run one round of it *fused* with the next round of
        every earlier batch still in flight; with ``last``, run rounds until none is left.

        A protocol of several rounds (PowerSGD: P, then Q) then costs one collective per
        batch plus one, instead of one per round per batch: batch i's second round travels
        with batch i+1's first. The schedule depends only on the order of the calls, so
        every rank issues the same collectives. Returns ``(token, means)`` for each batch
        this call finished, oldest first. Every rank must make the same calls, ending each
        step with ``last=True``; if a round fails, every batch in flight is dropped.
        """
        started, communicated = time.perf_counter(), 0.0
        batch = self._start(items, token, whole)
        self._in_flight.append(batch)
        try:
            communicated += self._round(self._in_flight, fresh=batch)
            while last and not all(b.done for b in self._in_flight):
                communicated += self._round(self._in_flight, fresh=None)
            if last:
                self._settle()
        except BaseException:
            self._in_flight.clear()
            self._drop_step()
            raise
        finished = [b for b in self._in_flight if b.done]
        self._in_flight = [b for b in self._in_flight if not b.done]
        try:
            return [(b.token, self._finish(b)) for b in finished]
        finally:
            self._account(started, communicated)

    @property
    def in_flight(self) -> int:
        """Batches started by :meth:`exchange_fused` whose rounds are not all done."""
        return len(self._in_flight)

    def _start(
        self, items: Sequence[GradientItem], token: Any = None, whole: Tensor | None = None
    ) -> Batch:
        """Compensate every gradient and start its protocol, up to its first request."""
        if not self._start_checked:
            check_same_start(self.step, self._origin, self.rank, self.communicator.group)
            self._start_checked = True
        batch = Batch(items, [], [], token)
        if self._before_step is None:  # the step's first exchange
            self._before_step = self.compressor.snapshot()
            if self.device_refusal is not None:
                self.device_refusal.poll()
        known = batch.known = self._surveys.of(items)  # keys, sizes, what is compressed
        slots = known.slots(self.step, self.world_size, self.rank)
        compressed = known.compressed
        grads = batch.grads = [item.grad for item in items]
        self._current.dense_bytes += known.total * 4
        plain = isinstance(self.memory, NoMemory)
        if plain and known.dtype == torch.float32:  # nothing to compensate or convert
            correcteds = grads
        elif plain:
            correcteds = self.memory.compensate_many(grads, slots, known.params)
        else:
            groups = arrange_memory(self.memory, grads, slots, compressed, self.compressor)
            correcteds = self.memory.compensate_many(grads, slots, known.params, groups)
        lazy = self._lazy(items)
        own = correcteds is grads or all(c is g for c, g in zip(correcteds, grads, strict=True))
        if whole is not None and not own:
            whole = None  # the memory compensated into tensors of its own
        planned_runs = plan_runs(correcteds, compressed, self.compressor, whole, known.sizes)
        # no verdict of its own where the checked sums show every rank's NaN and infinity
        shown = sums_show(planned_runs, self.compressor, self.dense)
        shown = shown and self.communicator.checks_sums
        # of the gradient, or what the memory added to it; deferred, checked only if asked
        checks = batch.checks = FiniteChecks(defer=lazy or shown)
        for planned in planned_runs:
            checks.add_together(planned.members, planned.tensor, planned.pieces)
        if lazy:  # the verdict travels as a device flag, read once at the step's end
            batch.poison = False if shown else checks.verdict()  # before any run writes
            self._suspects.append(batch)
        for planned in planned_runs:
            batch.runs.append(start_run(planned, correcteds, slots, self.compressor, self.dense))
        if lazy or shown:
            return batch
        for i in checks.failed():  # before any round: a non-finite one poisons the first,
            batch.not_finite.append(items[i].key)  # and the step is rolled back
        batch.poison = bool(batch.not_finite)
        return batch

    def _lazy(self, items: Sequence[GradientItem]) -> bool:
        """Whether this exchange reads its finiteness verdicts once per step (see
        :attr:`defer_verdicts`)."""
        if self.defer_verdicts is not None:
            return self.defer_verdicts
        return bool(items) and items[0].grad.device.type != "cpu"

    def _settle(self) -> None:
        """Read the verdicts of the step's lazy rounds (one wait for all of them); if some
        rank's gradients were not finite, roll the step back and raise on every rank (each
        reads the same flags from the same collectives)."""
        if not self._verdicts:
            self._suspects.clear()
            return
        if self._refuses_on_device():
            return  # end_step() settles them on the device
        flags = [flag.reshape(()).to(self._verdicts[0].device) for flag in self._verdicts]
        if bool(flags[0] if len(flags) == 1 else torch.stack(flags).any()):
            self._refuse()
        self._verdicts, self._suspects = [], []

    def _refuses_on_device(self) -> bool:
        """Whether this step's lazy verdicts stay on the device (:attr:`device_refusal`)."""
        return self.device_refusal is not None and self.device_refusal.ready

    def _commit(self) -> None:
        """Keep the step's memory; where its verdicts stayed on the device, keep it only
        where they say the step was taken, and the compressor's state likewise."""
        if not (self._verdicts and self._refuses_on_device()):
            self.memory.commit()
            return
        assert self.device_refusal is not None
        device = self._verdicts[0].device
        flags = [flag.to(device) for flag in self._verdicts]
        refused = self.device_refusal.settle(self.step, flags)
        self._verdicts, self._suspects = [], []
        self.memory.commit_unless(refused)
        if self._before_step is not None:
            self.compressor.undo_where(self._before_step, refused)

    def _refuse(self) -> None:
        """Refuse a lazy step some rank's non-finite gradients poisoned: name this rank's
        failed tensors (reading their checks), roll the step back, raise."""
        keys = [
            batch.items[i].key
            for batch in self._suspects
            if batch.checks is not None
            for i in batch.checks.failed()
        ]
        self._drop_step()
        raise NonFiniteGradientError(
            non_finite_message(self.step, self.rank, keys, self.compressor.name)
        )

    def _round(self, batches: Sequence[Batch], fresh: Batch | None) -> float:
        """Execute the pending request of every unfinished run of ``batches`` as one round
        (fused collectives), hand each run its answer; return the seconds spent
        communicating. ``fresh``: the batch whose first round this is (its non-finite
        gradients poison the round, so that every rank raises together)."""
        owners = [run for b in batches for run in b.runs if not run.done]
        if not owners:
            return 0.0
        poison = fresh.poison if fresh is not None else False
        lazy = bool(self._suspects)  # lazy batches take part in this round
        before = time.perf_counter()
        outcome = self.communicator.execute(
            [run.request for run in owners], poison=poison, lazy=lazy
        )
        spent = time.perf_counter() - before
        self._current.traffic.add(outcome.traffic)
        if isinstance(outcome.poisoned, Tensor):
            self._verdicts.append(outcome.poisoned)
        elif outcome.poisoned and lazy:  # a communicator that answered on the host
            self._refuse()
        elif outcome.poisoned:  # named here where the sums were the check
            failed = fresh.checks.failed() if fresh is not None and fresh.checks else []
            keys = fresh.not_finite or [fresh.items[i].key for i in failed] if fresh else []
            raise NonFiniteGradientError(
                non_finite_message(self.step, self.rank, keys, self.compressor.name)
            )
        for run, answer in zip(owners, outcome.answers, strict=True):
            run.advance(answer)
        return spent

    def _finish(self, batch: Batch) -> Means:
        """Let the memory keep what was not sent; the means in the gradients' dtypes."""
        if not isinstance(self.memory, NoMemory):
            update_memory(self.memory, batch.runs)
        self._current.tensors += len(batch.items)
        assert batch.known is not None and batch.grads is not None  # set by _start
        return bucket_means(batch.runs, batch.grads, batch.known)

    def _drop_step(self) -> None:
        """Undo a step whose exchange failed: it is not taken, so its counts must not add
        to the next one's, and the memory and the compressor go back to where they were
        before it (nothing of its gradients stays, nothing kept before is lost)."""
        self._current = StepStats(step=self.step)
        self._verdicts, self._suspects = [], []
        self.memory.rollback()
        if self._before_step is not None:
            self.compressor.load_state_dict(self._before_step)
            self._before_step = None

    def _account(self, started: float, communicated: float) -> None:
        """Add one call's time to the current step: communication, and the rest as math."""
        self._current.communicate_s += communicated
        self._current.compress_s += time.perf_counter() - started - communicated

    def end_step(self) -> StepStats:
        """Close the current optimizer step: record its statistics, advance the counter."""
        self._settle()
        if self._in_flight:
            self._in_flight.clear()
            raise RuntimeError(
                "end_step() with exchanges still in flight: the step's last exchange_fused() "
                "call must pass last=True (their results were dropped)"
            )
        self._commit()
        self._before_step = None
        stats = self._current
        stats.close()
        self.history.append(stats)
        self.step += 1
        self._current = StepStats(step=self.step)
        return stats

    @property
    def last_step(self) -> StepStats | None:
        """Statistics of the last finished step, if any."""
        return self.history[-1] if self.history else None

    def close(self) -> None:
        """Stop the exchange thread (it is a daemon; closing is optional)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    # -- agreement between ranks ----------------------------------------------------------

    def verify(self, parameters: Iterable[tuple[str, Tensor]]) -> None:
        """Check that every rank has the same parameters (names, shapes and dtypes) and the
        same compressor setup; raise :class:`RankMismatchError` naming what differs.
        Collective: all ranks call it."""
        shapes = list(parameters)
        setup = f"{self.compressor!r}|{self.communicator.name}|{type(self.memory).__name__}"
        layouts, setups = ranks_differing(
            [parameter_layout(shapes), setup], self.communicator.group
        )
        problems = [f"rank {r} has different parameters (names, shapes or dtypes)" for r in layouts]
        problems += [f"rank {r} uses a different compressor or communicator" for r in setups]
        if problems:
            raise RankMismatchError(
                f"ranks disagree (seen from rank {self.rank}): {'; '.join(problems)}. "
                f"This rank has {len(shapes)} parameters and uses {setup}. Every rank must "
                "build the same model and call thinwire with the same compressor options."
            )

    # -- checkpointing --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly: step, compressor, memory,
        and whose they are (``owner``: this rank, the world size, the compressor and its
        options, the memory), since residuals, momenta and warm starts are one rank's own.
        For a checkpoint that one rank writes, use :meth:`full_state_dict`."""
        return {
            "step": self.step,
            "compressor": self.compressor.state_dict(),
            "memory": self.memory.state_dict(),
            "owner": self._owner(),
            "bucket_orders": {i: list(names) for i, names in self.bucket_orders.items()},
        }

    def full_state_dict(self) -> dict[str, Any]:
        """Every rank's :meth:`state_dict` in one object, the same on every rank, for
        checkpoints that one rank writes (frameworks save rank 0's copy only); each rank
        takes its own part in :meth:`load_state_dict`. Collective: every rank calls it
        after the same number of steps."""
        return gather_states(self.state_dict(), self.communicator.group)

    def _owner(self) -> dict[str, Any]:
        memory = type(self.memory).__name__
        return owner_of(self.rank, self.world_size, repr(self.compressor), memory)

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` saying what to do unless ``state`` is this exchange's own:
        saved by this rank of a job of this size, with the same compressor and memory
        (an all-ranks state from :meth:`full_state_dict`: its part for this rank)."""
        if is_all_ranks(state):
            state, _ = own_part(state, self.rank, self.world_size)
        check_owner(state, self._owner(), option_defaults(self.compressor))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` or :meth:`full_state_dict` returned, after
        :meth:`check_state`. At its first exchange every rank then checks that all ranks
        start from the same step and all-ranks checkpoint, and raises
        :class:`~thinwire.errors.RankMismatchError` if some resumed and others did not."""
        origin = 0
        if is_all_ranks(state):
            state, origin = own_part(state, self.rank, self.world_size)
        check_owner(state, self._owner(), option_defaults(self.compressor))
        self.step = int(state["step"])
        self._current = StepStats(step=self.step)
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])
        self._origin = origin
        orders = {int(i): list(names) for i, names in state.get("bucket_orders", {}).items()}
        self.restored_bucket_orders, self.bucket_orders = orders, dict(orders)
