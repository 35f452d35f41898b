"""``thinwire bench --plans``: hybrid-parallel plans trained side by side on local ranks.

Each plan trains the task's model from the same initialisation on the same global batches
(AdamW, linear warm-up then cosine decay), with real compute, and reports its loss curve,
held-out perplexity, the data-parallel bytes each rank sent per step (thinwire's engine's
count) and the wall time per step. Real compute of 8 ranks on a small machine measures the
scheduler more than the plan: read these runs for quality; time plans on virtual
accelerators (``compute="sleep"``, :mod:`thinwire.bench.hybrid_sleep`).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from thinwire.bench.step_budget import check_budget
from thinwire.cluster import EmulatedCluster
from thinwire.cluster.uplink import check_uplink_queue
from thinwire.compress import compressor
from thinwire.launch import LocalPool, Placement
from thinwire.parallel import ParallelPlan, ParallelTrainer, parallelize
from thinwire.parallel.plan_spec import plan_label
from thinwire.plan.activations import SavedActivations
from thinwire.plan.memory import MemoryEstimate, held_bytes
from thinwire.tasks import task


@dataclass(frozen=True)
class HybridConfig:
    """What ``thinwire bench --plans`` runs."""

    task: str
    plans: tuple[ParallelPlan, ...]
    steps: int
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    optimizer: str = "adamw"
    """``"adamw"`` or ``"sgd"`` (with ``momentum``; none for a compressor that applies its
    own, as DGC does)."""
    momentum: float = 0.9
    task_options: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 3600.0
    network: str = "loopback"
    """``"emulated"``: ``hosts`` emulated hosts of ``ranks_per_host`` ranks (root);
    ``"loopback"``: every rank on this machine's loopback, no limits."""
    ranks_per_host: int = 1
    bandwidth: str = "100mbit"
    latency: str = "1ms"
    compute: str = "real"
    """``"real"``: train and evaluate; ``"sleep"``: time ``steps`` steps on virtual
    accelerators (:mod:`thinwire.bench.hybrid_sleep`), no losses or perplexity."""
    uplink_queue: int | None = None
    """Packets in each emulated host's uplink queue (None: 10 ms of the link)."""
    untimed_steps: int = 3
    """Under ``compute="sleep"``: the first steps, left out of the step time. A plan's
    first steps run slow while its ranks' memory and sockets warm up (on two emulated
    hosts the third step of a 27 M GPT still took up to 1.4x the steady one,
    docs/planner-measurements.md); the planner predicts the steady state."""
    step_budget_s: float | None = None
    """Under ``compute="sleep"``: seconds of steps per plan. A plan whose first step says
    its ``steps`` would take longer warms up at most two steps and is timed for as many as
    fit, at least two (:mod:`thinwire.bench.step_budget`); ``None``: every plan runs
    ``steps``."""

    def __post_init__(self) -> None:
        sizes = {plan.world_size for plan in self.plans}
        if len(sizes) != 1:
            raise ValueError(
                f"the plans need different numbers of ranks ({sorted(sizes)}): list plans of "
                "one world size per run"
            )
        (world,) = sizes
        if self.network == "emulated" and world % self.ranks_per_host:
            raise ValueError(
                f"the plans run {world} ranks, which hosts of --ranks-per-host "
                f"{self.ranks_per_host} do not divide: use a divisor of {world}"
            )
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.untimed_steps < 0:
            raise ValueError(f"--untimed-steps must be >= 0, got {self.untimed_steps}")
        if self.compute == "sleep" and self.steps <= self.untimed_steps:
            raise ValueError(
                f"--steps {self.steps} leaves no step to time after the "
                f"{self.untimed_steps} untimed ones: pass --steps "
                f"{self.untimed_steps + 3} or more (or fewer --untimed-steps)"
            )
        check_uplink_queue(self.uplink_queue)
        check_budget(self.step_budget_s)
        if self.step_budget_s is not None and self.compute != "sleep":
            raise ValueError(
                "--step-budget times plans on virtual accelerators: add --compute sleep, or "
                "leave it out (real compute trains for --steps)"
            )
        if self.compute not in ("real", "sleep"):
            raise ValueError(f"--compute must be real or sleep, got {self.compute!r}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"--optimizer must be adamw or sgd, got {self.optimizer!r}")
        batch = task(self.task, **self.task_options).batch_size
        for plan in self.plans:  # refused here, not on the ranks minutes into a sweep
            try:
                plan.check_batch(batch)
            except ValueError as error:
                raise ValueError(f"plan {plan_label(plan)}: {error}") from error


def learning_rate(step: int, config: HybridConfig) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to a tenth."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def optimizer_for(config: HybridConfig, plan: ParallelPlan) -> Any:
    """The optimizer factory of ``config`` for ``plan``: AdamW, or SGD with momentum (none
    when the plan's compressor applies momentum itself)."""
    if config.optimizer == "adamw":
        return lambda p: torch.optim.AdamW(p, lr=config.lr, weight_decay=config.weight_decay)
    own = plan.dp_method != "dense" and getattr(
        compressor(plan.dp_method, **plan.dp_options), "momentum", 0.0
    )
    momentum = 0.0 if own else config.momentum
    return lambda p: torch.optim.SGD(
        p, lr=config.lr, momentum=momentum, weight_decay=config.weight_decay
    )


def train_plan(rank: int, world: int, config: HybridConfig, plan: ParallelPlan) -> dict | None:
    """On every rank: train under ``plan``; rank 0 returns the record."""
    job = task(config.task, **config.task_options)
    trainer = parallelize(job.build_model(), plan, optimizer=optimizer_for(config, plan))
    losses, seconds, sent = [], [], []
    saved = SavedActivations(exclude=[p for _, p in trainer.named_parameters()])
    for step in range(config.steps):
        for group in trainer.local_optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        inputs, targets = job.global_batch(step)
        start = time.perf_counter()
        with saved if step == 0 else contextlib.nullcontext():
            losses.append(trainer.step(inputs, targets))
        seconds.append(time.perf_counter() - start)
        stats = trainer.engine.last_step if trainer.engine is not None else None
        sent.append(stats.sent_bytes if stats is not None else 0)
    chunk = plan.dp * plan.microbatches * max(1, 32 // (plan.dp * plan.microbatches))
    perplexity = job.evaluate_parallel(trainer, chunk)
    memory = rank_memory(trainer, saved.peak_bytes)
    trainer.close()
    if rank != 0:
        return {"memory": memory}
    return {
        "memory": memory,
        "plan": plan_label(plan),
        "degrees": {"dp": plan.dp, "pp": plan.pp, "tp": plan.tp},
        "losses": losses,
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "perplexity": perplexity,
        "step_s": sorted(seconds)[len(seconds) // 2],
        "dp_sent_bytes_per_step": sum(sent[1:]) / max(1, len(sent) - 1),
    }


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def rank_memory(trainer: ParallelTrainer, activations: int) -> dict[str, int]:
    """What this rank holds: its parameter shards, their gradients, the optimizer's state,
    thinwire's exchange state (residuals, warm starts) and the step's saved activations."""
    named = trainer.named_parameters()
    optimizer = trainer.local_optimizer
    engine = trainer.engine
    estimate = MemoryEstimate(
        parameters=sum(_local_bytes(p) for _, p in named),
        gradients=sum(_local_bytes(p.grad) for _, p in named),
        optimizer=sum(
            _local_bytes(v)
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ),
        exchange=held_bytes(engine.compressor, engine.memory) if engine is not None else 0,
        activations=activations,
    )
    return estimate.as_dict()


FAILURES_IN_A_ROW = 3
"""A sweep stops after this many plans failed one after the other: then the bed (the
emulated cluster, the machine's memory, a port) is failing, not the plans."""


@dataclass
class HybridSweep:
    """What :func:`run_hybrid` measured: a record per plan that ran, and for each plan that
    failed its label and the error (also in ``results.json`` under ``"failed"``)."""

    records: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)


def run_hybrid(config: HybridConfig, out: Path, report: Any = print) -> HybridSweep:
    """Train every plan in turn, each on fresh local ranks; write ``results.json``.

    Fresh ranks per plan: the ranks of one pool had grown to 3.4 GB each after seven plans
    of a 27 M GPT (the kernel killed one at the eighth), and a plan's first steps would
    otherwise depend on what the plans before it left in the ranks' memory.

    A plan that fails (a rank's error, a timeout, a pool that does not start) is recorded
    with its error and the sweep goes on to the next: one plan's failure had cost a sweep
    the six plans after it. After :data:`FAILURES_IN_A_ROW` failures in a row the sweep
    stops with an error naming them, the records so far written."""
    out.mkdir(parents=True, exist_ok=True)
    job = task(config.task, **config.task_options)
    getattr(job, "corpus", None)  # make the data (and its cache) before the ranks start
    sweep = HybridSweep()
    with contextlib.ExitStack() as stack:
        world, placement = config.plans[0].world_size, None
        if config.network == "emulated":
            cluster = EmulatedCluster(
                world // config.ranks_per_host, config.bandwidth, config.latency,
                ranks_per_host=config.ranks_per_host, uplink_queue=config.uplink_queue,
            )  # fmt: skip
            placement = Placement.on(stack.enter_context(cluster))
        shared: dict = {}  # stage profiles, shared by plans of the same shape
        in_a_row = 0
        for plan in config.plans:
            try:
                sweep.records.append(run_one_plan(config, plan, world, placement, report, shared))
                in_a_row = 0
            except Exception as error:  # recorded, reported, then the next plan
                in_a_row += 1
                sweep.failed.append({"plan": plan_label(plan), "error": str(error)})
                report(f"  {plan_label(plan)} failed: {error}")
            _write(config, sweep, out)
            if in_a_row >= FAILURES_IN_A_ROW:
                names = ", ".join(f["plan"] for f in sweep.failed[-in_a_row:])
                raise RuntimeError(
                    f"{in_a_row} plans failed in a row ({names}), the last with: "
                    f"{sweep.failed[-1]['error']}\nthe sweep stopped: look at the bed (free "
                    f"memory, 'thinwire cluster' namespaces, ports); the {len(sweep.records)} "
                    f"plans that ran are in {out / 'results.json'}"
                )
    return sweep


def run_one_plan(
    config: HybridConfig, plan: ParallelPlan, world: int, placement: Placement | None,
    report: Any, shared: dict,
) -> dict:  # fmt: skip
    """One plan of a sweep on fresh ranks: timed on virtual accelerators under
    ``compute="sleep"``, else trained; its record."""
    with LocalPool(world, collective_timeout_s=300, placement=placement) as pool:
        if config.compute == "sleep":
            return time_on_sleeping_ranks(pool, config, plan, report, shared)
        return _train(pool, config, plan, report)


def _write(config: HybridConfig, sweep: HybridSweep, out: Path) -> None:
    summary: dict[str, Any] = {"config": _describe(config), "records": sweep.records}
    if sweep.failed:
        summary["failed"] = sweep.failed
    (out / "results.json").write_text(json.dumps(summary, indent=2))


def _train(pool: LocalPool, config: HybridConfig, plan: ParallelPlan, report: Any) -> dict:
    report(f"training {plan_label(plan)} for {config.steps} steps")
    results = pool.run(train_plan, config, plan, timeout=config.timeout_s)
    record = results[0]
    record["memory_per_rank"] = [r.pop("memory") for r in results]
    record["peak_memory_bytes"] = max(m["total"] for m in record["memory_per_rank"])
    report(
        f"  loss {record['final_loss']:.4f}  perplexity {record['perplexity']:.3f}  "
        f"{record['step_s']:.2f} s/step  peak memory per rank "
        f"{record['peak_memory_bytes'] / 2**20:.1f} MiB"
    )
    return record


def time_on_sleeping_ranks(
    pool: LocalPool, config: HybridConfig, plan: ParallelPlan, report: Any,
    shared: dict | None = None,
) -> dict:  # fmt: skip
    """Profile ``plan``'s stages (or take those of an earlier plan of the same shape from
    ``shared``), then time it on ``pool``'s ranks as virtual accelerators."""
    from thinwire.bench.hybrid_sleep import profile, sleeping_record, time_plan

    budget = "" if config.step_budget_s is None else f" (within {config.step_budget_s:g} s)"
    report(f"profiling {plan_label(plan)}'s stages, then {config.steps} sleeping steps{budget}")
    profiles = profile(config, plan, shared)
    results = pool.run(time_plan, config, plan, profiles, timeout=config.timeout_s)
    record = sleeping_record(config, plan, profiles, results)
    ran = len(record["steps_s"])
    cut = f" ({ran} steps, {record['untimed_steps']} untimed)" if ran < config.steps else ""
    report(
        f"  {record['step_s']:.3f} s/step{cut}  {record['tokens_per_s']:.0f} tokens/s  between "
        f"hosts {record['sent_between_hosts'] / 1e6:.2f} MB/step (model "
        f"{record['modelled_between_hosts'] / 1e6:.2f})  within hosts "
        f"{record['sent_within_host'] / 1e6:.2f} MB/step (model "
        f"{record['modelled_within_host'] / 1e6:.2f})"
    )
    return record


def _describe(config: HybridConfig) -> dict:
    described = asdict(config)
    described["plans"] = [plan_label(p) for p in config.plans]
    return described


def plot_losses(records: list[dict], path: Path) -> Path:
    """Training loss per step of each plan (a 20-step moving mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for record in records:
        losses = torch.tensor(record["losses"])
        window = min(20, len(losses))
        smooth = losses.unfold(0, window, 1).mean(dim=1)
        ax.plot(range(window - 1, len(losses)), smooth, label=record["plan"])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (20-step mean)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
