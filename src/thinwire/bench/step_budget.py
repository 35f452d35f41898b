"""How many steps a sleeping plan runs under ``thinwire bench --step-budget``.

A sweep times every plan for ``--steps`` steps, the first ``--untimed-steps`` left out.
On a slow link the slowest plans take minutes a step (a dense exchange of a 25 M model
at 10 Mbit/s: over a minute), and eight steps of each would take a sweep of a few
hundred plans most of a day. Their steps are long enough that one is an average over
thousands of packets. So with a budget, a plan whose first step says ``--steps`` of them
would overrun it warms up for at most :data:`WARM_UP_STEPS` and is timed for as many
steps as the budget holds after them, never fewer than :data:`MIN_TIMED_STEPS` (or than
were asked for, if fewer) and never more than it would have been without a budget. Two
warm-up steps, not one: DDP rebuilds its buckets after the first step, and a dense 8x1x1
step at 100 Mbit/s took 17 s from the third step on but 20-22 s in the second as in the
first. Every rank must run the same steps: they agree on the count from rank 0's first
step (:func:`agreed_seconds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: timed steps a plan runs at the least, however far over the budget (the median of two
#: is their mean)
MIN_TIMED_STEPS = 2
#: untimed steps a plan over the budget keeps at the most (fewer if fewer were asked for)
WARM_UP_STEPS = 2


@dataclass(frozen=True)
class StepCount:
    """The steps a plan runs and how many of the first of them are left out of its time."""

    steps: int
    untimed: int
    shortened: bool = False
    """Whether the budget cut the steps asked for."""


def check_budget(budget_s: float | None) -> None:
    """Refuse a budget that is not a positive, finite number of seconds."""
    if budget_s is None:
        return
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)):
        raise ValueError(f"--step-budget must be seconds, got {budget_s!r}")
    if not (0 < budget_s < math.inf):
        raise ValueError(
            f"--step-budget must be > 0 s and finite, got {budget_s}: give the seconds of "
            "steps one plan may take (e.g. 240), or leave it out to run every --steps"
        )


def steps_within(
    first_step_s: float, steps: int, untimed: int, budget_s: float | None
) -> StepCount:
    """The steps a plan whose first step took ``first_step_s`` runs, asked for ``steps`` of
    which ``untimed`` are left out, within ``budget_s`` seconds of steps (``None``: no
    budget). Within the budget, or with nothing to cut, the plan runs as asked."""
    check_budget(budget_s)
    if not 0 <= untimed < steps:
        raise ValueError(f"{steps} steps leave none to time after {untimed} untimed ones")
    if not (first_step_s >= 0 and math.isfinite(first_step_s)):
        raise ValueError(f"a step cannot take {first_step_s} s")
    asked = StepCount(steps, untimed)
    timed = steps - untimed
    if budget_s is None or steps * first_step_s <= budget_s:
        return asked
    warm = min(untimed, WARM_UP_STEPS)
    fits = math.floor((budget_s - warm * first_step_s) / first_step_s)
    kept = min(timed, max(MIN_TIMED_STEPS, fits))
    if (warm + kept, warm) == (steps, untimed):
        return asked
    return StepCount(warm + kept, warm, shortened=True)


def agreed_seconds(seconds: float) -> float:
    """Rank 0's ``seconds``, on every rank of the default process group (one broadcast)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.broadcast(value, src=0)
    return float(value.item())
