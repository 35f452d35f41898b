"""The planner explains itself: the chosen plan and where its step goes, the runners-up
and their margins, why the others lost (over the memory limit by how much, slower by how
much, left out), and the bandwidth between hosts at which the choice would change.

:func:`choice_changes` predicts the same prepared plans on the probe's links made slower
and faster (:func:`thinwire.plan.nominal_links.scale_between_hosts`), doubling until another
plan wins, then halving the interval; :func:`explain_text` and :func:`explain_json` write
the answer for a person and for a program.
"""

from __future__ import annotations

from typing import Any

from thinwire.parallel.interleaved_program import INTERLEAVED
from thinwire.plan.model_costs import ModelCosts
from thinwire.plan.nominal_links import between_hosts_bps, scale_between_hosts
from thinwire.plan.probe import LinkProbe
from thinwire.plan.search import Evaluated, SearchResult, rank

#: the widest change of bandwidth looked at, each way (a factor of 2 ** 7 = 128)
DOUBLINGS = 7
#: halvings of the interval where the choice changes (2 ** (1 / 2 ** 5): within 2.2 %)
REFINEMENTS = 5


def _best(result: SearchResult, probe: LinkProbe) -> str | None:
    fitting, _ = rank(result.prepared, probe, result.memory_limit)
    return fitting[0].label if fitting else None


def choice_changes(result: SearchResult, probe: LinkProbe) -> dict[str, dict[str, Any] | None]:
    """Per direction (``"slower"``, ``"faster"``), the bandwidth between hosts past which
    another plan wins and that plan (``None``: the same choice over a factor of 128)."""
    base = between_hosts_bps(probe)
    if base is None or not result.ranked:
        return {"slower": None, "faster": None}
    chosen = result.chosen.label
    answer: dict[str, dict[str, Any] | None] = {}
    for direction, sign in (("slower", -1), ("faster", 1)):
        answer[direction] = None
        near_exponent = 0.0
        for step in range(1, DOUBLINGS + 1):
            exponent = sign * step
            winner = _best(result, scale_between_hosts(probe, 2.0**exponent))
            if winner == chosen:
                near_exponent = exponent
                continue
            far_exponent = exponent
            for _ in range(REFINEMENTS):
                middle = (near_exponent + far_exponent) / 2
                pick = _best(result, scale_between_hosts(probe, 2.0**middle))
                if pick == chosen:
                    near_exponent = middle
                else:
                    far_exponent, winner = middle, pick
            answer[direction] = {"bandwidth_bps": base * 2.0**far_exponent, "plan": winner}
            break
    return answer


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _rate(bps: float) -> str:
    for unit, size in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= size:
            return f"{bps / size:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def _breakdown(chosen: Evaluated) -> list[str]:
    p = chosen.prediction
    exposed = p.bubble_s
    lines = [
        f"  predicted step {p.step_s:.3f} s: compute {p.compute_s:.3f} s, tensor-parallel "
        f"all-reduces {p.tensor_s:.3f} s, pipeline bubble and messages {exposed:.3f} s, "
        f"data-parallel exchange {p.data_parallel_s:.3f} s, optimizer {p.optimizer_s:.3f} s, "
        f"recomputation {p.recompute_s:.3f} s",
        f"  peak memory per rank {_gib(p.peak_memory_bytes)}; per pipeline rank:",
    ]
    two = chosen.plan.schedule == INTERLEAVED
    pp = chosen.plan.pp
    for index, held in enumerate(p.memory):
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in held.items() if k != "total")
        name = f"stages {index} and {index + pp}" if two else f"stage {index}"
        lines.append(f"    {name}: {_gib(held['total'])} ({parts})")
    return lines


def explain_text(
    result: SearchResult,
    costs: ModelCosts,
    probe: LinkProbe,
    links: str,
    changes: dict[str, dict[str, Any] | None],
    top: int = 5,
) -> str:
    """The planner's answer as lines for a person."""
    limit = result.memory_limit
    out = [
        f"model {costs.source.name}: {costs.parameters / 1e6:.1f} M parameters, "
        f"{costs.blocks} blocks, global batch {costs.batch_size}",
        f"cluster: {probe.hosts} host(s) x {probe.ranks_per_host} ranks; links: {links}; "
        f"memory limit: {_gib(limit) + ' per rank' if limit else 'none'}",
        f"searched {len(result.prepared)} plans in {result.seconds:.2f} s",
        "",
    ]
    if not result.ranked:
        out.append(f"no plan fits: {_why_none(result)}")
        return "\n".join(out)
    chosen = result.chosen
    out += [f"chosen: {chosen.label}", *_breakdown(chosen), "", "next best:"]
    for place, other in enumerate(result.ranked[1 : top + 1], start=2):
        margin = other.prediction.step_s / chosen.prediction.step_s - 1
        out.append(
            f"  {place}. {other.label}: {other.prediction.step_s:.3f} s (+{margin:.1%}), "
            f"peak {_gib(other.prediction.peak_memory_bytes)}"
        )
    out.append("rejected:")
    if result.too_large:
        shown = ", ".join(
            f"{e.label} needs {_gib(e.prediction.peak_memory_bytes)} ({_gib(e.over_bytes)} over)"
            for e in result.too_large[:top]
        )
        more = len(result.too_large) - min(top, len(result.too_large))
        out.append(
            f"  over the memory limit ({len(result.too_large)}): {shown}"
            + (f", and {more} more" if more else "")
        )
    slower = result.ranked[top + 1 :]
    if slower:
        worst = slower[-1]
        out.append(
            f"  slower ({len(slower)}): by "
            f"+{slower[0].prediction.step_s / chosen.prediction.step_s - 1:.1%} to "
            f"+{worst.prediction.step_s / chosen.prediction.step_s - 1:.1%} "
            f"(the slowest: {worst.label})"
        )
    if result.refused:
        shown = "; ".join(f"{label}: {why}" for label, why in result.refused[:top])
        more = len(result.refused) - min(top, len(result.refused))
        out.append(
            f"  left out ({len(result.refused)}): {shown}" + (f"; and {more} more" if more else "")
        )
    out.append("the choice changes:")
    for direction, word in (("slower", "below"), ("faster", "above")):
        change = changes.get(direction)
        if change is None:
            out.append(f"  {direction}: not within a factor of {2**DOUBLINGS} of these links")
        else:
            out.append(f"  {word} {_rate(change['bandwidth_bps'])} between hosts: {change['plan']}")
    return "\n".join(out)


def _why_none(result: SearchResult) -> str:
    if not result.too_large:
        return "no plan is possible on this cluster (see the plans left out)"
    least = result.too_large[0]
    return (
        f"the smallest, {least.label}, needs {_gib(least.prediction.peak_memory_bytes)} per "
        f"rank ({_gib(least.over_bytes)} over the limit): raise --memory, add ranks or "
        "choose a smaller batch"
    )


def _row(evaluated: Evaluated, chosen: Evaluated | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "plan": evaluated.label,
        "fits": evaluated.fits,
        "over_bytes": max(0, evaluated.over_bytes),
        "prediction": evaluated.prediction.as_dict(),
    }
    if chosen is not None:
        row["margin"] = evaluated.prediction.step_s / chosen.prediction.step_s - 1
    return row


def explain_json(
    result: SearchResult,
    costs: ModelCosts,
    probe: LinkProbe,
    links: str,
    changes: dict[str, dict[str, Any] | None],
) -> dict[str, Any]:
    """The planner's answer for a program: every plan with its prediction."""
    chosen = result.ranked[0] if result.ranked else None
    return {
        "model": {
            "name": costs.source.name,
            "options": dict(costs.source.options),
            "parameters": costs.parameters,
            "blocks": costs.blocks,
            "batch_size": costs.batch_size,
        },
        "cluster": {"hosts": probe.hosts, "ranks_per_host": probe.ranks_per_host},
        "links": links,
        "memory_limit": result.memory_limit,
        "search_s": result.seconds,
        "chosen": None if chosen is None else chosen.label,
        "ranked": [_row(e, chosen) for e in result.ranked],
        "too_large": [_row(e, chosen) for e in result.too_large],
        "refused": [{"plan": label, "reason": why} for label, why in result.refused],
        "choice_changes": changes,
    }
