"""Repeated benchmark runs: the method list run several times in turn, and what they show.

On a busy or shared machine the compute-only step itself moves between runs minutes apart
(on the 2-core test bed, by 20 % and more), so one run of ``local`` and one of a method
give a ratio with that much noise in it. ``thinwire bench --repeats N`` runs the whole
method list N times on the same processes and network, in order on odd repeats and in
reverse order on even ones (A B C, C B A, A B C, ...), so that a slow drift of the
machine's speed weighs on every method alike. Each repeat's ratios are taken against
that repeat's own ``local`` and ``dense``, and :func:`summarise_repeats` reports, per
method, the median over the repeats with the smallest and largest value.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, TypeVar

Item = TypeVar("Item")

#: per-repeat figures summarised per method
SUMMARISED = (
    "step_s_median",
    "wall_step_s",
    "scaling_efficiency",
    "wall_scaling_efficiency",
    "throughput_vs_dense",
    "bytes_sent_per_step",
)


def check_repeats(repeats: object) -> None:
    """Refuse a repeat count that is not a whole number >= 1."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(
            f"repeats must be an integer >= 1 (how many times the method list runs), got "
            f"{repeats!r}"
        )


def repeat_order(methods: Sequence[Item], repeat: int) -> list[Item]:
    """The methods in the order repeat ``repeat`` (counted from 1) runs them: as given on
    odd repeats, reversed on even ones."""
    return list(methods) if repeat % 2 == 1 else list(reversed(methods))


def repeat_label(name: str, repeat: int, repeated: bool) -> str:
    """``name`` as a repeated run shows it (``dgc #2``); as it is in a single run."""
    return f"{name} #{repeat}" if repeated else name


def by_repeat(records: Sequence[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """The records grouped by their ``repeat`` (1 where a record has none: a single run)."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(record.get("repeat", 1), []).append(record)
    return groups


def summarise_repeats(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method (in the order first seen): how many repeats ran it and, for each figure
    of :data:`SUMMARISED` that the records have, its median, smallest and largest value
    over the repeats (``{"median": m, "min": a, "max": b, "values": [...]}``, the values
    in repeat order)."""
    methods: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        methods.setdefault(record["method"], []).append(record)
    summary = []
    for runs in methods.values():
        runs = sorted(runs, key=lambda r: r.get("repeat", 1))
        entry: dict[str, Any] = {
            "method": runs[0]["method"],
            "options": runs[0].get("options", {}),
            "repeats": len(runs),
        }
        for name in SUMMARISED:
            values = [r[name] for r in runs if r.get(name) is not None]
            if values:
                entry[name] = {
                    "median": statistics.median(values),
                    "min": min(values),
                    "max": max(values),
                    "values": values,
                }
        summary.append(entry)
    return summary
