"""What a hybrid step does after its pipeline, timed per rank for ``thinwire bench``.

The cost model splits a step into the pipeline, the data-parallel exchange and the
optimizer step (:class:`thinwire.plan.hybrid_cost.PlanPrediction`); a sleeping run's
timeline showed only the pipeline's computes, so a plan predicted short could not say
which part the model missed. :class:`StepPhases` notes, on one rank, when its trainer
averaged the gradients over the ``dp`` group (``"X"``: the optimizer wrapper's
``synchronize``) and when it stepped the wrapped optimizer (``"O"``), as
``(kind, start, end)`` in :attr:`StepPhases.events`, beside the computes the sleeping
stages note, and how many minor page faults the process took meanwhile
(:attr:`StepPhases.faults`: a fresh page of a buffer the exchange allocates costs one).
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

#: the kinds noted, with what they stand for
PHASES = {"X": "data-parallel exchange", "O": "optimizer step"}


class StepPhases:
    """Times a trainer's exchange and optimizer step from now on.

    Args:
        trainer: a :class:`thinwire.parallel.trainer.ParallelTrainer`. Its optimizer is
            either thinwire's data-parallel wrapper (``synchronize`` then the wrapped
            optimizer's ``step``) or, under ``dp = 1``, a plain ``torch.optim`` optimizer.
    """

    def __init__(self, trainer: Any) -> None:
        self.events: list[tuple[str, float, float]] = []
        self.faults: dict[str, int] = {}
        outer = trainer.optimizer
        inner = getattr(outer, "optimizer", outer)
        if hasattr(outer, "synchronize") and inner is not outer:
            outer.synchronize = self._timed("X", outer.synchronize)
        if hasattr(inner, "register_step_pre_hook"):
            self._started = 0.0
            inner.register_step_pre_hook(self._optimizer_starts)
            inner.register_step_post_hook(self._optimizer_ends)

    def _timed(self, kind: str, call: Callable[[], None]) -> Callable[[], None]:
        def timed() -> None:
            faults = minor_faults()
            start = time.perf_counter()
            try:
                call()
            finally:
                self.events.append((kind, start, time.perf_counter()))
                self.faults[kind] = self.faults.get(kind, 0) + minor_faults() - faults

        return timed

    def _optimizer_starts(self, *_: Any) -> None:
        self._started = time.perf_counter()

    def _optimizer_ends(self, *_: Any) -> None:
        self.events.append(("O", self._started, time.perf_counter()))

    def seconds(self, kind: str) -> float:
        """The seconds the events of ``kind`` noted so far took, together."""
        return sum(end - start for noted, start, end in self.events if noted == kind)


def minor_faults() -> int:
    """The minor page faults this process (every thread of it) has taken so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


#: timed repeats of each way :func:`exchange_alone` runs the exchange (one more untimed)
ALONE_REPEATS = 3


def engine_split(trainer: Any) -> tuple[float, float]:
    """The seconds the data-parallel engine's last step spent in memory and compressor
    work and inside collectives (:class:`thinwire.comm.step_stats.StepStats`); zeros
    without an engine (``dp = 1``) or before its first step."""
    stats = trainer.engine.last_step if getattr(trainer, "engine", None) is not None else None
    return (stats.compress_s, stats.communicate_s) if stats is not None else (0.0, 0.0)


def exchange_alone(trainer: Any, phases: StepPhases) -> dict[str, float]:
    """This rank's data-parallel exchange of its last step's gradients, run again outside
    any step, on every rank: the median seconds of ``"together"`` (every ``dp`` group at
    once, as when every stage exchanges in the same moment) and ``"by_stage"`` (one
    pipeline stage's groups at a time, the others waiting at a barrier). Beside the same
    exchange inside the steps (``"X"``), it says whether a step's exchange took longer
    than the exchange itself does on these groups (and so the cost model's exchange, which
    is the latter, is short) or not. Beside each, the engine's split of it
    (:func:`engine_split`: ``"together_compress"``, ``"together_communicate"``, and the
    same for ``"by_stage"``), and the minor page faults the process took meanwhile
    (``"together_faults"``, ``"by_stage_faults"``). Empty under ``dp = 1``. It leaves
    ``phases`` as it found it.
    Call it on every rank at once (it synchronizes them with barriers)."""
    import torch.distributed as dist

    if trainer.plan.dp == 1 or not hasattr(trainer.optimizer, "synchronize"):
        return {}
    kept = list(phases.events)
    stage = trainer.mesh["pp"].get_local_rank()
    medians = {}
    for mode, turns in (("together", [None]), ("by_stage", range(trainer.plan.pp))):
        seconds, splits, faults = [], [], []
        for _ in range(ALONE_REPEATS + 1):
            for turn in turns:
                dist.barrier()
                if turn is None or turn == stage:
                    before = minor_faults()
                    start = time.perf_counter()
                    trainer.optimizer.synchronize()
                    seconds.append(time.perf_counter() - start)
                    faults.append(minor_faults() - before)
                    splits.append(engine_split(trainer))
        dist.barrier()
        medians[mode] = statistics.median(seconds[1:])
        medians[f"{mode}_compress"] = statistics.median(c for c, _ in splits[1:])
        medians[f"{mode}_communicate"] = statistics.median(c for _, c in splits[1:])
        medians[f"{mode}_faults"] = statistics.median(faults[1:])
    phases.events[:] = kept
    return medians
