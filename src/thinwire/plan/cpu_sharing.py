"""The CPU that ranks share: how much slower a rank's CPU work runs while others run theirs.

The probe times an optimizer step on rank 0 alone and then with the first ``c`` ranks
running it at once, for ``c`` = 2, 4, ... up to every rank, the slowest of them
(:func:`probe_slowdowns`). On a machine whose ranks share a few cores (the emulated
cluster: eight ranks on two) the step is about four times slower with all eight; with
two at once it is hardly slower. The job is an AdamW step over 8 M parameters (128 MB of
weights, gradients and moments a rank), past the caches as a model shard's step is: one
over 2 M parameters, as the probe timed before, read 3.1-4.2x with all eight ranks in
four probes a minute apart, 8 M 4.1-4.4x in four (16 M: 4.4-4.6x; docs/planner-measurements.md,
"The CPU the ranks share").

The cost model uses the curve where ranks do CPU work after the pipeline (the
data-parallel compression and the optimizer step): a pipeline's stages end at different
times, so fewer ranks compete at once than "every rank" (on the 2-host, 4-stage plans
of the 1 Gbit/s sweep the optimizer step was predicted 0.07 s at every rank's slowdown
and measured 0.01-0.02 s). :func:`shared_finish` runs the groups' CPU work under
processor sharing: while ``c`` ranks are busy, each progresses at ``1 / slowdown(c)``.
A plan without a pipeline has one group, which finishes at the every-rank slowdown, as
before. The curve counts ranks over the whole cluster, as the probe ran them (the first
``c`` ranks, so a host's first): on machines of their own per host it reads each host's
contention at its ends and approximates it between them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

#: the parameters of the probe's optimizer step (past the caches, as a model shard's)
JOB_PARAMETERS = 8 * 1024 * 1024


def concurrency_levels(world: int) -> list[int]:
    """The rank counts the probe times: 1, 2, 4, ... and ``world``."""
    levels, c = [], 1
    while c < world:
        levels.append(c)
        c *= 2
    return [*levels, world]


def probe_slowdowns(
    rank: int, world: int, repeats: int, job: Callable[[], float] | None = None
) -> dict[int, float]:
    """The time for an 8 M-parameter AdamW step (two of them) with the first ``c`` ranks
    running it at once, over rank 0's time alone, for each of :func:`concurrency_levels`:
    per repeat the slowest of the ``c`` ranks (the step waits for the last of them, and
    the ranks sharing the cores are not served evenly), then the median of ``repeats``.
    Collective: every rank calls it; all get the same figures. ``job`` (run, return its
    seconds) replaces the optimizer step, for tests."""
    import torch
    import torch.distributed as dist

    from thinwire.plan.probe import slowest_rank_median

    if job is None:
        weight = torch.nn.Parameter(torch.zeros(JOB_PARAMETERS))
        weight.grad = torch.ones_like(weight)
        optimizer = torch.optim.AdamW([weight], lr=1e-3)

        def job() -> float:
            start = time.perf_counter()
            for _ in range(2):
                optimizer.step()
            return time.perf_counter() - start

    job()  # warm up
    levels = concurrency_levels(world)
    times: dict[int, list[float]] = {c: [] for c in levels}
    for _ in range(repeats):
        for c in levels:
            dist.barrier()
            if rank < c:
                times[c].append(job())
    dist.barrier()
    slowest = [  # 0 where this rank sat out
        slowest_rank_median(times[c] if rank < c else [0.0] * repeats) for c in levels
    ]
    alone = slowest[0]
    return {c: max(1.0, t / alone) for c, t in zip(levels, slowest, strict=True)}


def slowdown_curve(
    measured: Sequence[tuple[int, float]], world: int, every_rank: float
) -> Callable[[float], float]:
    """The slowdown with ``c`` ranks busy, interpolated linearly between the probe's
    ``measured`` (count, slowdown) points and held at the ends; a probe from before the
    curve was measured (``measured`` empty) gives a line from 1 (one rank) to
    ``every_rank`` (``world`` ranks)."""
    known = {1: 1.0, **{int(c): float(s) for c, s in measured}}
    if not measured:
        known[max(1, world)] = max(1.0, every_rank)
    points = sorted(known.items())

    def slowdown(ranks: float) -> float:
        if ranks <= points[0][0]:
            return points[0][1]
        for (c0, s0), (c1, s1) in itertools.pairwise(points):
            if ranks <= c1:
                return s0 + (s1 - s0) * (ranks - c0) / (c1 - c0)
        return points[-1][1]

    return slowdown


def shared_finish(
    starts: Sequence[float],
    work: Sequence[float],
    ranks: Sequence[int],
    slowdown: Callable[[float], float],
) -> list[float]:
    """When each group's CPU work ends: group ``k``'s ``ranks[k]`` ranks each start
    ``work[k]`` seconds (timed alone) at ``starts[k]``; while ``c`` ranks are busy each
    progresses at ``1 / slowdown(c)`` (processor sharing)."""
    left = [max(0.0, w) for w in work]
    finish = [s if w <= 0 else float("inf") for s, w in zip(starts, left, strict=True)]
    pending = sorted((s, k) for k, s in enumerate(starts) if left[k] > 0)
    active: set[int] = set()
    now = pending[0][0] if pending else 0.0
    while pending or active:
        while pending and pending[0][0] <= now:
            active.add(pending.pop(0)[1])
        if not active:
            now = pending[0][0]
            continue
        rate = 1.0 / max(1.0, slowdown(sum(ranks[k] for k in active)))
        first_done = min(left[k] / rate for k in active)
        step = min(first_done, pending[0][0] - now) if pending else first_done
        now += step
        for k in list(active):
            left[k] -= step * rate
            if left[k] <= 1e-12:
                finish[k] = now
                active.discard(k)
    return finish
