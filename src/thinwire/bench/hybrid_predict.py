"""Predicted against measured: the hybrid cost model on ``thinwire bench --plans`` records.

For each record of a sleeping sweep (``--compute sleep``): the plan's stages profiled on one
process (:mod:`thinwire.plan.stage_profile`: the collectives each stage issues, its
data-parallel exchange measured through the real engine, its optimizer step), the compute
the run's virtual accelerators slept (the record's ``stage_compute_s``: an input of the
run, not a result), and links a ``thinwire probe`` measured on the same cluster: the cost
model (:mod:`thinwire.plan.hybrid_cost`) predicts the step, which the record measured.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import statistics
from pathlib import Path
from typing import Any

from thinwire.parallel.plan_spec import parse_plan
from thinwire.plan.block_profiles import cost_of
from thinwire.plan.hybrid_cost import Degrees, StageCost, predict_plan
from thinwire.plan.probe import LinkProbe
from thinwire.plan.stage_profile import StageProfile, profile_plan
from thinwire.tasks import task


def stage_costs(
    profiles: list[StageProfile], compute: list[dict[str, float]] | None = None
) -> list[StageCost]:
    """The cost model's view of each stage: its profile, with the compute ``compute`` gives
    (per stage ``forward`` and ``backward`` seconds) in place of the profiled, if given."""
    costs = []
    for profile in sorted(profiles, key=lambda p: p.index):
        cost = cost_of([profile], profile.activation_bytes)
        if compute is not None:
            given = next(c for c in compute if c["stage"] == profile.index)
            cost = cost.with_compute(
                given["forward"], given["backward"], given.get("recompute", cost.recompute_s)
            )
        costs.append(cost)
    return costs


def profiles_for(config: dict[str, Any], spec: str, cache: Path) -> list[StageProfile]:
    """The stage profiles of plan ``spec`` under the sweep's ``config``, kept in ``cache``
    (one pickle per plan and task) so that several bandwidths share them."""
    plan = parse_plan(spec)
    options = config.get("task_options", {})
    fields = sorted(StageProfile.__dataclass_fields__)  # a profile of other fields is stale
    key = json.dumps([config["task"], options, spec, config.get("optimizer"), fields])
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.pkl"
    if path.exists():
        try:
            stored_key, profiles = pickle.loads(path.read_bytes())
        except (pickle.UnpicklingError, ImportError, AttributeError, EOFError, ValueError):
            stored_key = None  # written by another version of thinwire: profile again
        if stored_key == key:
            return profiles
    batch = task(config["task"], **options).batch_size
    profiles = profile_plan(
        config["task"],
        options,
        plan,
        batch // (plan.dp * plan.microbatches),
        optimizer=config.get("optimizer", "adamw"),
    )
    path.write_bytes(pickle.dumps((key, profiles)))
    return profiles


def predict_sweep(results: Path, probe: LinkProbe, cache: Path) -> dict[str, Any]:
    """Every record of the sweep in ``results`` (a ``results.json``), predicted."""
    sweep = json.loads(results.read_text())
    config = sweep["config"]
    rows = []
    for record in sweep["records"]:
        plan = parse_plan(record["plan"])
        degrees = Degrees(plan.dp, plan.pp, plan.tp, plan.microbatches, plan.schedule)
        costs = stage_costs(profiles_for(config, record["plan"], cache), record["stage_compute_s"])
        predicted = predict_plan(degrees, costs, probe)
        rows.append(
            {
                "plan": record["plan"],
                "measured_s": record["step_s"],
                "predicted_s": predicted.step_s,
                "error": predicted.step_s / record["step_s"] - 1,
                "memory": _memory_against(predicted.memory, record, plan),
                "breakdown": predicted.as_dict(),
            }
        )
    errors = [abs(r["error"]) for r in rows]
    return {
        "results": str(results),
        "bandwidth": config.get("bandwidth"),
        "rows": rows,
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "spearman": (
            spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
            if len(rows) > 1
            else None
        ),
    }


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists (ties share their mean rank)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("Spearman's correlation needs two lists of the same length >= 2")

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    return statistics.correlation(ranks(xs), ranks(ys))


def _memory_against(predicted: tuple[dict[str, int], ...], record: dict, plan: Any) -> dict:
    """Per pipeline rank, predicted and measured bytes (its first rank; its two stages
    together under interleaved 1F1B), with the ratio of the saved activations and of the
    total."""
    per_stage = plan.dp * plan.tp
    rows = []
    for stage, held in enumerate(predicted):
        measured = record["memory_per_rank"][stage * per_stage]
        rows.append(
            {
                "stage": stage,
                "predicted": held,
                "measured": measured,
                "activations_error": held["activations"] / measured["activations"] - 1,
                "total_error": held["total"] / measured["total"] - 1,
            }
        )
    return {
        "stages": rows,
        "peak_error": max(h["total"] for h in predicted) / record["peak_memory_bytes"] - 1,
    }
