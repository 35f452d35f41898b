"""``thinwire bench``: one task, several methods, side by side on an emulated cluster.

    thinwire bench --task fashion --workers 4 --bandwidth 10mbit --latency 1ms \\
                   --methods local,dense,ddp-powersgd,dgc,powersgd --steps 20 --out runs/b1

The same worker processes (one per emulated host) train the task once per method, from the
same initial weights on the same batches. Each record in ``DIR/results.json`` holds the
method, its options, the network, the step-time medians over the measured steps (after
DGC's warm-up), the bytes each rank sent per step as counted by the kernel, the final
training loss and the held-out metric. ``local`` (no exchange) gives the compute-only step
time, so ``scaling_efficiency = local step time / method step time``, and
``wall_scaling_efficiency`` is the same ratio of wall-clock time per step, the one that
counts for ``dga`` and ``ps-async``, whose ranks do not wait for each other. On the emulated
cluster the links are probed first: one all-reduce of the model's size (the bandwidth the
ring delivers to it) and two larger ones that separate the link's bandwidth from the fixed
cost of an all-reduce. On ``--network loopback`` run as root, the ranks share a network
namespace of their own (:mod:`thinwire.cluster.private`), so the byte counts are this run's
alone; without root they use the machine's loopback, whose counters count every process.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from thinwire.bench.faults import FaultSchedule, ScheduledFault
from thinwire.bench.link_probe import measure_link
from thinwire.bench.methods import Method
from thinwire.bench.ratios import add_ratios, throughput_step_s
from thinwire.bench.repeats import by_repeat, check_repeats, repeat_label, repeat_order
from thinwire.bench.sleeping import Stage, check_compute
from thinwire.bench.worker import (
    BenchJob,
    check_lr_schedule,
    measure_stages,
    read_progress,
    train_method,
)
from thinwire.cluster import ClusterError, EmulatedCluster, check_can_emulate
from thinwire.cluster.private import check_private_loopback, private_loopback
from thinwire.data_parallel.buckets import BucketSpec, check_bucket_spec
from thinwire.launch import LocalPool, Placement
from thinwire.strategies.parameter_server import check_servers

if TYPE_CHECKING:
    from thinwire.plan.cost import ComputeTime


@dataclass(frozen=True)
class BenchConfig:
    """A benchmark run. ``network``: ``"emulated"`` (needs root) or ``"loopback"``."""

    task: str
    methods: list[Method]
    workers: int = 4
    bandwidth: str = "100mbit"
    latency: str = "1ms"
    steps: int = 20
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    task_options: dict[str, Any] = field(default_factory=dict)
    network: str = "emulated"
    measure_from: int | None = None
    evaluate: bool = True
    bucket_cap_mb: BucketSpec = None
    fuse_rounds: bool = True
    timeout_s: float = 3600.0
    lr_schedule: str = "constant"
    compute: str = "real"
    #: under ``compute="sleep"``: the virtual accelerator is this many times this CPU
    compute_speedup: float = 1.0
    broadcast_buffers: bool = True
    repeats: int = 1
    #: link faults ordered in every method's run (:mod:`thinwire.bench.faults`)
    faults: tuple[ScheduledFault, ...] = ()
    #: packets in each emulated host's uplink queue (None: 10 ms of the link)
    uplink_queue: int | None = None

    def __post_init__(self) -> None:
        """Check everything that can be checked before any process starts."""
        from thinwire.cluster import parse_duration, parse_rate
        from thinwire.cluster.uplink import check_uplink_queue
        from thinwire.tasks import task as build_task

        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 2:
            raise ValueError(
                f"steps must be an integer >= 2 (one to warm up, one to measure), got "
                f"{self.steps!r}"
            )
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}")
        if self.network not in ("emulated", "loopback"):
            raise ValueError(f"network must be 'emulated' or 'loopback', got {self.network!r}")
        if not self.methods:
            raise ValueError("no methods given; e.g. local,dense,dgc,powersgd")
        if not (self.lr > 0):
            raise ValueError(f"the learning rate must be > 0, got {self.lr!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if not 0 <= self.weight_decay < float("inf"):
            raise ValueError(f"weight decay must be a number >= 0, got {self.weight_decay!r}")
        if self.measure_from is not None and not 0 <= self.measure_from < self.steps:
            raise ValueError(
                f"measure-from must be a step in 0 .. {self.steps - 1} (steps - 1), got "
                f"{self.measure_from!r}"
            )
        for method in self.methods:
            check_servers(method.name, method.options, self.workers)
        check_bucket_spec(self.bucket_cap_mb)
        check_repeats(self.repeats)
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"the timeout must be a number of seconds > 0, got {self.timeout_s!r}")
        check_lr_schedule(self.lr_schedule)
        check_compute(
            self.compute,
            self.compute_speedup,
            [m.name for m in self.methods if m.strategy.embedding],
        )
        parse_rate(self.bandwidth)
        parse_duration(self.latency)
        check_uplink_queue(self.uplink_queue)
        if self.faults and self.network != "emulated":
            raise ValueError("--fault needs --network emulated (faults break emulated links)")
        if not isinstance(self.task_options, dict):
            raise ValueError(f"task options must be a JSON object, got {self.task_options!r}")
        build_task(self.task, seed=self.seed, **self.task_options)  # unknown task or option

    def first_measured_step(self) -> int:
        """Steps before this one are left out of the timings (warm-up, DGC's dense start)."""
        if self.measure_from is not None:
            return min(self.measure_from, self.steps - 1)
        warmups = [m.options.get("warmup_steps", 0) for m in self.methods]
        # PyTorch's powerSGD_hook all-reduces densely for its first 2 steps
        warmups += [m.options.get("start_powerSGD_iter", 0) for m in self.methods]
        return min(max([1, *warmups, self.steps // 5]), self.steps - 1)


def run_bench(config: BenchConfig, out: Path, console: Console | None = None) -> list[dict]:
    """Run every method of ``config`` (the whole list ``config.repeats`` times, in
    alternating order: :mod:`thinwire.bench.repeats`), write ``out/results.json`` and
    return the records, each with its ``repeat`` (from 1)."""
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    records = []
    with (
        _network(config, console) as (placement, interface, describe, check_network, order_fault),
        tempfile.TemporaryDirectory() as scratch,
    ):
        progress_file = str(Path(scratch) / "progress")
        with LocalPool(config.workers, collective_timeout_s=600, placement=placement) as pool:
            pool.run(_ready, timeout=300)
            if config.network == "emulated" and config.workers > 1:
                describe.update(measure_link(pool, config, console, describe["bandwidth_bps"]))
            stages = _measure_stages(pool, config, console) if config.compute == "sleep" else None
            if stages is not None:
                describe["slept_forward_s"] = sum(s.forward_s for s in stages)
                describe["slept_backward_s"] = sum(s.backward_s for s in stages)
            with Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} steps {task.fields[loss]}"),
                TimeElapsedColumn(),
                console=console,
            ) as bar:
                runs = [
                    (number, method)
                    for number in range(1, config.repeats + 1)
                    for method in repeat_order(config.methods, number)
                ]
                for repeat, method in runs:
                    label = repeat_label(method.name, repeat, config.repeats > 1)
                    shown = bar.add_task(f"{label:>13}", total=config.steps, loss="")
                    job = BenchJob(
                        task=config.task,
                        method=method,
                        steps=config.steps,
                        lr=config.lr,
                        task_options=config.task_options,
                        momentum=config.momentum,
                        weight_decay=config.weight_decay,
                        seed=config.seed,
                        measure_from=config.first_measured_step(),
                        interface=interface,
                        progress=progress_file,
                        evaluate=config.evaluate and stages is None,
                        bucket_cap_mb=config.bucket_cap_mb,
                        fuse_rounds=config.fuse_rounds,
                        lr_schedule=config.lr_schedule,
                        stages=None if stages is None else tuple(stages),
                        broadcast_buffers=config.broadcast_buffers,
                    )
                    Path(progress_file).unlink(missing_ok=True)
                    schedule = FaultSchedule(config.faults, order_fault)

                    def update(shown: Any = shown, schedule: Any = schedule) -> None:
                        check_network()
                        seen = read_progress(progress_file)
                        if seen:
                            bar.update(shown, completed=seen[0], loss=f"loss {seen[1]:.3f}")
                        schedule.poll(seen[0] if seen else 0)

                    began = time.perf_counter()
                    try:
                        ranks = pool.run(
                            train_method, job, timeout=config.timeout_s, while_waiting=update
                        )
                    finally:
                        if schedule.faults:
                            schedule.clear()
                    wall = time.perf_counter() - began
                    bar.update(
                        shown, completed=config.steps, loss=f"loss {ranks[0]['losses'][-1]:.3f}"
                    )
                    records.append(_record(config, method, repeat, ranks, wall, describe))
                    if schedule.faults:
                        records[-1]["faults"] = schedule.applied
                    add_ratios(records)
                    _save(records, out)  # a later failure keeps what was measured
    add_ratios(records)
    if config.network == "emulated" and config.workers > 1:
        with console.status("cost model: profiling compute and compression in this process"):
            add_predictions(config, records)
    _save(records, out)
    return records


def _save(records: list[dict[str, Any]], out: Path) -> None:
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(records, indent=2))
    tmp.replace(out / "results.json")


def _ready(rank: int, world_size: int) -> int:
    return rank


def _measure_stages(pool: LocalPool, config: BenchConfig, console: Console) -> list[Stage]:
    """Every rank times the real model's stages at once; each stage's times are averaged
    over the ranks, so every rank then sleeps the same."""
    with console.status("measuring the model's compute, stage by stage, on every rank"):
        per_rank = pool.run(
            measure_stages,
            config.task,
            config.task_options,
            config.seed,
            timeout=config.timeout_s,
        )
    first = per_rank[0]
    if any([s.name for s in stages] != [s.name for s in first] for stages in per_rank):
        raise RuntimeError("ranks called the model's modules in different orders")
    speedup = config.compute_speedup
    stages = [
        Stage(
            stage.name,
            statistics.fmean(r[i].forward_s for r in per_rank) / speedup,
            statistics.fmean(r[i].backward_s for r in per_rank) / speedup,
        )
        for i, stage in enumerate(first)
    ]
    forward = sum(s.forward_s for s in stages)
    backward = sum(s.backward_s for s in stages)
    faster = f", {speedup:g}x faster than this CPU" if speedup != 1 else ""
    console.print(
        f"compute: sleeps of the measured {len(stages)} stages{faster}, {forward:.3f} s "
        f"forward and {backward:.3f} s backward a step (timings only: the losses mean nothing)"
    )
    return stages


#: what a run's network gives it: the ranks' placement, the interface, its description, a
#: check that it still works, and how to order a link fault
NetworkParts = tuple[Placement | None, str, dict[str, Any], Callable[[], None], Callable[..., None]]


@contextlib.contextmanager
def _network(config: BenchConfig, console: Console) -> Iterator[NetworkParts]:
    if config.network == "loopback":
        described = {"network": "loopback", "bandwidth": None, "latency": None}
        with contextlib.ExitStack() as stack:
            namespace, reason = None, check_private_loopback()
            if reason is None:
                try:
                    namespace = stack.enter_context(private_loopback())
                except RuntimeError as error:
                    reason = str(error)
            if namespace is None:
                console.print(
                    f"loopback: the machine's own ({reason}), so its byte counts include "
                    "whatever else crosses it meanwhile"
                )
                yield None, "lo", {**described, "loopback_private": False}, _fine, _no_faults
                return
            console.print("loopback: a private network namespace, only this run's traffic")
            placement = Placement((namespace,) * config.workers, "127.0.0.1", "lo")
            yield placement, "lo", {**described, "loopback_private": True}, _fine, _no_faults
        return
    if config.network != "emulated":
        raise ValueError(f"--network must be 'emulated' or 'loopback', got {config.network!r}")
    reason = check_can_emulate()
    if reason:
        raise RuntimeError(reason)

    with EmulatedCluster(
        config.workers, config.bandwidth, config.latency, uplink_queue=config.uplink_queue
    ) as cluster:
        queue = f", uplink queue {config.uplink_queue} packets" if config.uplink_queue else ""
        console.print(
            f"emulated cluster: {config.workers} hosts, {config.bandwidth} links, "
            f"{config.latency} one-way latency (MTU {cluster.mtu}{queue})"
        )
        yield (
            Placement.on(cluster),
            cluster.hosts[0].interface,
            {
                "network": "emulated",
                "bandwidth": config.bandwidth,
                "latency": config.latency,
                "bandwidth_bps": cluster.rate_bps,
                "latency_s": cluster.latency_s,
                "uplink_queue_packets": config.uplink_queue,
            },
            lambda: _check_switch(cluster),
            cluster.fault,
        )


def _fine() -> None:
    """Loopback needs no watching."""


def _no_faults(**order: Any) -> None:
    """Loopback has no links to break (refused before any run: BenchConfig)."""
    raise ValueError("link faults need the emulated cluster")


def _check_switch(cluster: EmulatedCluster) -> None:
    """Fail the run at once if the emulated switch died (every link would be down)."""
    if not cluster.forwarder_alive():
        raise ClusterError(
            "the emulated cluster's forwarder died, so every link is down; see the kernel log "
            "or rerun (thinwire cluster status shows leftovers)"
        )


def _record(
    config: BenchConfig,
    method: Method,
    repeat: int,
    ranks: list[dict],
    wall: float,
    network: dict[str, Any],
) -> dict[str, Any]:
    first = config.first_measured_step()
    lead = ranks[0]
    # a synchronous step ends on every rank together; the slowest rank's clock is the truth
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(config.steps)]
    losses = [statistics.fmean(r["losses"][i] for r in ranks) for i in range(config.steps)]
    tail = max(1, config.steps // 10)
    ends = [max(r["ends_s"][i] for r in ranks) for i in range(config.steps)]
    # wall-clock per step once every rank finished step first-1 until all finished the last
    wall_step = (ends[-1] - (ends[first - 1] if first > 0 else 0.0)) / (config.steps - first)
    return {
        "task": config.task,
        "method": method.name,
        "options": method.options,
        "repeat": repeat,
        "workers": config.workers,
        **network,
        "steps": config.steps,
        "measured_from_step": first,
        "wall_s": wall,
        "step_s_median": statistics.median(step_s[first:]),
        "wall_step_s": wall_step,
        "forward_s_median": statistics.median(r["forward_s_median"] for r in ranks),
        "backward_s_median": statistics.median(r["backward_s_median"] for r in ranks),
        "optimizer_s_median": statistics.median(r["optimizer_s_median"] for r in ranks),
        "cpu_s_per_step": statistics.fmean(r["cpu_s_per_step"] for r in ranks),
        "bytes_sent_per_step": statistics.fmean(r["sent_bytes_per_step"] for r in ranks),
        "bytes_received_per_step": statistics.fmean(r["received_bytes_per_step"] for r in ranks),
        "thinwire": lead["thinwire"],
        "final_train_loss": statistics.fmean(losses[-tail:]),
        "eval_metric": lead.get("eval_metric"),
        "eval_value": lead.get("eval_value"),
        "loss_history": losses,
        "time_history_s": ends,
        "config": {k: v for k, v in asdict(config).items() if k != "methods"},
    }


def add_predictions(config: BenchConfig, records: list[dict[str, Any]]) -> None:
    """Put the cost model's prediction beside each measured record (``predicted``), with
    compute calibrated to the measured ``local`` step (the same processes' compute), and
    compression to the ranks' CPU: the local step's factor where they compute for real,
    under ``--compute sleep`` the CPU seconds they measured before sleeping them
    (:func:`sleeping_cpu_scale`), since a virtual accelerator 50x this CPU does not
    compress 50x faster."""
    from thinwire.plan import Link, profile_model
    from thinwire.plan.profile import task_lookups
    from thinwire.tasks import task as build_task

    modelled = {m.name: m.options for m in config.methods}
    task = build_task(config.task, seed=config.seed, **config.task_options)
    model = task.build_model()
    options: dict[str, Any] = {}
    if config.bucket_cap_mb is not None:
        options["bucket_cap_mb"] = config.bucket_cap_mb
    if any(m.strategy.embedding for m in config.methods):
        options["lookups"] = task_lookups(task, model, config.workers)
    profile = profile_model(
        model,
        task.batch(0, config.workers, 0),
        task.loss,
        modelled,
        world_size=config.workers,
        fuse_rounds=config.fuse_rounds,
        broadcast_buffers=config.broadcast_buffers,
        **options,
    )
    emulated = EmulatedCluster(config.workers, config.bandwidth, config.latency, tag="plan")
    if emulated.rate_bps is None:
        return  # unlimited links: nothing for an alpha-beta model to predict
    link = Link(emulated.rate_bps, emulated.latency_s, mtu=emulated.mtu)
    for repeat in by_repeat(records).values():
        local = next((r["step_s_median"] for r in repeat if r["method"] == "local"), None)
        for record in (r for r in repeat if r["method"] in modelled):
            cpu_scale = sleeping_cpu_scale(config, record, profile.compute.time)
            predicted = profile.predict(
                record["method"], link, compute=local, cpu_scale=cpu_scale
            ).as_dict()
            predicted["error"] = predicted["step_s"] / throughput_step_s(record) - 1
            record["predicted"] = predicted


def sleeping_cpu_scale(
    config: BenchConfig, record: dict[str, Any], profiled: ComputeTime
) -> float | None:
    """Under ``--compute sleep``: how much slower the ranks' CPU ran a forward and backward
    pass (what they measured before sleeping a ``compute_speedup``-th of it) than this
    process's profile did; ``None`` where the ranks compute for real (the local step then
    calibrates both) or the record lacks the measurement."""
    if config.compute != "sleep":
        return None
    slept = record.get("slept_forward_s", 0.0) + record.get("slept_backward_s", 0.0)
    passes = profiled.forward_s + profiled.backward_s
    if slept <= 0 or passes <= 0:
        return None
    return slept * config.compute_speedup / passes
