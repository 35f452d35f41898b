"""What a benchmark's records mean beside each other: scaling efficiency, compression and
throughput against ``dense``, each against ``local`` and ``dense`` of the record's own
repeat."""

from __future__ import annotations

from typing import Any

from thinwire.bench.repeats import by_repeat
from thinwire.strategies import strategy


def throughput_step_s(record: dict[str, Any]) -> float:
    """The time per step that a record's throughput is: the median of the slowest rank's
    step for synchronous methods, the wall-clock time per step for ``dga`` and
    ``ps-async`` (their ranks do not wait for each other, so the slowest rank of each step
    is a different rank at a different time)."""
    if not strategy(record["method"]).synchronised:
        return record["wall_step_s"]
    return record["step_s_median"]


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Fill in what needs several methods: compute-only time, communication not hidden,
    scaling efficiency, compression ratio against dense and throughput against dense,
    each against ``local`` and ``dense`` of the record's own repeat."""
    for repeat in by_repeat(records).values():
        _add_ratios_of_one_run(repeat)


def _add_ratios_of_one_run(records: list[dict[str, Any]]) -> None:
    by_name = {r["method"]: r for r in records}
    local, dense = by_name.get("local"), by_name.get("dense")
    for record in records:
        compute = local["step_s_median"] if local else None
        record["compute_s_median"] = compute
        record["comm_s_median"] = (
            max(0.0, record["step_s_median"] - compute) if compute is not None else None
        )
        record["scaling_efficiency"] = compute / record["step_s_median"] if compute else None
        record["wall_scaling_efficiency"] = (
            local["wall_step_s"] / record["wall_step_s"] if local else None
        )
        record["compression_ratio"] = (
            dense["bytes_sent_per_step"] / record["bytes_sent_per_step"]
            if dense and record["bytes_sent_per_step"] > 0 and record["method"] != "local"
            else (record["thinwire"] or {}).get("compression_ratio_median")
        )
        record["throughput_vs_dense"] = (
            dense["step_s_median"] / record["step_s_median"] if dense else None
        )
        record["wall_throughput_vs_dense"] = (
            dense["wall_step_s"] / record["wall_step_s"] if dense else None
        )
        record["steps_per_s"] = 1.0 / record["step_s_median"]
