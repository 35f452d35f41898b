"""``thinwire plan``: profile a task, predict every method's step, print a table and JSON.

thinwire plan --task fashion --workers 4 --bandwidth 100mbit --latency 1ms
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from thinwire.data_parallel.buckets import BucketSpec, check_bucket_spec
from thinwire.plan.breakeven import BreakEven, plan
from thinwire.plan.cost import StepPrediction
from thinwire.plan.network import Link, format_bytes, format_rate
from thinwire.strategies import strategy
from thinwire.strategies.parameter_server import check_servers

#: the method that break-even bandwidths are measured against
REFERENCE = "dense"

Rows = Sequence[tuple[StepPrediction, BreakEven | None]]

#: what ``thinwire plan`` predicts when no ``--methods`` are given
DEFAULT_PLAN_METHODS = (
    "local",
    "dense",
    "ddp-fp16",
    "ddp-powersgd",
    "fp16",
    "powersgd",
    "powersgd-oneround",
    "dgc",
    "onebit",
    "terngrad",
)


@dataclass(frozen=True)
class PlanRequest:
    """Validated inputs of ``thinwire plan``: bandwidth in bits/s, latency in s."""

    task: str
    workers: int
    bandwidth_bps: float
    latency_s: float
    methods: dict[str, dict[str, Any]] = field(default_factory=dict)
    task_options: dict[str, Any] = field(default_factory=dict)
    #: None: DDP's default (1 MB, then 25 MB); a size in MB; "tapered[:TAIL:FACTOR]"
    bucket_cap_mb: BucketSpec = None
    broadcast_buffers: bool = True  #: DDP's option: buffers sent before each forward


def parse_request(
    task: str,
    workers: int,
    bandwidth: str,
    latency: str,
    methods: str = "",
    options: str = "",
    bucket_cap_mb: BucketSpec = None,
    broadcast_buffers: bool = True,
    task_options: str = "",
) -> PlanRequest:
    """Check and convert the command-line strings; ``ValueError`` says what is wrong.

    ``methods``: comma-separated names (default :data:`DEFAULT_PLAN_METHODS`); ``options``:
    JSON of options per method, e.g. ``{"dgc": {"density": 0.01}}`` (a method named only
    there is added). ``bucket_cap_mb`` and ``broadcast_buffers``: the DDP options the
    methods under DDP are modelled with. ``task_options``: JSON of the task's options, e.g.
    ``{"batch_size": 80}``.
    """
    from thinwire.cluster.units import parse_duration, parse_rate

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers must be an integer >= 1, got {workers!r}")
    rate = parse_rate(bandwidth)
    if rate is None:
        raise ValueError(f"--bandwidth must be a finite rate such as 100mbit, got {bandwidth!r}")
    delay = parse_duration(latency)
    check_bucket_spec(bucket_cap_mb, "--bucket-cap-mb")
    names = [n.strip() for n in methods.split(",") if n.strip()] or list(DEFAULT_PLAN_METHODS)
    chosen: dict[str, dict[str, Any]] = {name: {} for name in names}
    if options:
        try:
            given = json.loads(options)
        except json.JSONDecodeError as error:
            raise ValueError(f"--options is not valid JSON ({error}): {options!r}") from None
        if not isinstance(given, dict) or not all(isinstance(v, dict) for v in given.values()):
            raise ValueError(
                '--options must map method names to option objects, e.g. {"dgc": {"density": '
                f"0.01}}}}, got {options!r}"
            )
        chosen.update(given)
    for name, opts in chosen.items():
        chosen[name] = strategy(name).options(opts)
        check_servers(name, chosen[name], workers)
    try:
        built = json.loads(task_options) if task_options else {}
    except json.JSONDecodeError as error:
        raise ValueError(f"--task-options is not valid JSON ({error}): {task_options!r}") from None
    if not isinstance(built, dict):
        raise ValueError(
            f'--task-options must be a JSON object, e.g. {{"batch_size": 80}}, got {task_options!r}'
        )
    return PlanRequest(
        task,
        workers,
        rate,
        delay,
        chosen,
        task_options=built,
        bucket_cap_mb=bucket_cap_mb,
        broadcast_buffers=broadcast_buffers,
    )


def run_plan(request: PlanRequest) -> tuple[Any, Rows]:
    """Profile ``request.task`` and predict each method: ``(profile, rows)``."""
    from thinwire.plan.profile import profile_task
    from thinwire.tasks import task as build_task

    methods = dict(request.methods)
    methods.setdefault(REFERENCE, {})  # the break-even reference, shown only if asked for
    ddp: dict[str, Any] = {"broadcast_buffers": request.broadcast_buffers}
    if request.bucket_cap_mb is not None:
        ddp["bucket_cap_mb"] = request.bucket_cap_mb
    profile = profile_task(
        build_task(request.task, **request.task_options),
        methods,
        world_size=request.workers,
        **ddp,
    )
    link = Link(request.bandwidth_bps, request.latency_s)
    rows = plan(profile.compute.time, profile.costs, link, request.workers, reference=REFERENCE)
    shown = [row for row in rows if row[0].method in request.methods]
    return profile, shown


def plan_table(rows: Rows, title: str) -> Table:
    """A rich table with one row per method: bytes this rank contributes per step and what
    the ring algorithms make it send, the compression ratio, collectives per step, the time
    split, scaling efficiency and the bandwidth below which the method beats dense."""
    table = Table(title=title)
    for column in (
        "method",
        "bytes/rank",
        "sent/rank",
        "ratio",
        "coll.",
        "compute s",
        "compress s",
        "comm s",
        "step s",
        "efficiency",
        "beats dense",
    ):
        table.add_column(column, justify="left" if column == "method" else "right", no_wrap=True)
    for prediction, verdict in rows:
        ratio = prediction.compression_ratio
        table.add_row(
            prediction.method,
            format_bytes(prediction.payload_bytes),
            format_bytes(prediction.sent_bytes),
            "-" if math.isnan(ratio) else f"{ratio:.3g}x",
            str(prediction.collectives),
            _seconds(prediction.compute_s),
            _seconds(prediction.compress_s),
            _seconds(prediction.comm_s),
            _seconds(prediction.step_s),
            f"{prediction.efficiency:.0%}",
            verdict.describe() if verdict is not None else "-",
        )
    return table


def plan_title(request: PlanRequest) -> str:
    """The table's title: task, workers, link."""
    return (
        f"thinwire plan: {request.task}, {request.workers} workers, "
        f"{format_rate(request.bandwidth_bps)}, latency {request.latency_s * 1e3:g} ms"
    )


def plan_json(request: PlanRequest, profile: Any, rows: Rows) -> dict[str, Any]:
    """Everything the table shows, plus the inputs and the compute profile, as JSON data."""
    compute = profile.compute.time
    return {
        "task": request.task,
        "task_options": request.task_options,
        "workers": request.workers,
        "bandwidth_bps": request.bandwidth_bps,
        "latency_s": request.latency_s,
        "bucket_cap_mb": request.bucket_cap_mb,
        "broadcast_buffers": request.broadcast_buffers,
        "compute": {
            "forward_s": compute.forward_s,
            "backward_s": compute.backward_s,
            "optimizer_s": compute.optimizer_s,
        },
        "methods": [
            {
                **prediction.as_dict(),
                "options": _jsonable(profile.costs[prediction.method].options),
                "buckets": len(profile.costs[prediction.method].buckets),
                "break_even": verdict.as_dict() if verdict is not None else None,
            }
            for prediction, verdict in rows
        ],
    }


def write_json(data: Mapping[str, Any], path: str | Path) -> None:
    """Write ``data`` to ``path`` as strict JSON (NaN and infinities become ``null``;
    directories are created)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(_finite(data), indent=2, allow_nan=False) + "\n")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _seconds(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _jsonable(options: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
        for k, v in options.items()
    }
