"""``thinwire bench --plans --compute sleep``: plans timed on virtual accelerators.

Per plan: every stage's shard is profiled on one process (:mod:`thinwire.plan.stage_profile`,
one core to itself), then every rank builds the real trainer, takes one real step's
gradients without exchanging them, and runs ``steps`` steps in which each stage sleeps
its profiled compute and replays its tensor-parallel collectives
(:mod:`thinwire.bench.sleeping_stages`); the pipeline's sends, the loss, the
data-parallel exchange (and its compressor) and the optimizer run for real. Each rank
counts the bytes it sent within its host and to other hosts (the kernel's socket
counters, :mod:`thinwire.bench.traffic`), beside the cost model's count for the plan
(:mod:`thinwire.plan.plan_traffic`), and what the real forward and backward pass sent (the
pipeline's and tensor parallelism's traffic without the data-parallel exchange, at the
second real step, past the schedule's shape inference: under ``dp=1`` the sleeping steps
must send the same). The step time is the median of the steps after the
``untimed_steps`` first (the steady state, which the planner predicts; fewer steps of both
kinds for a plan over ``step_budget_s``, :mod:`thinwire.bench.step_budget`); the last step's
timeline notes each compute, the data-parallel exchange and the optimizer step
(:mod:`thinwire.bench.step_phases`); each rank's exchange is timed on every step, and once
more after the steps outside any step (:func:`~thinwire.bench.step_phases.exchange_alone`;
not for a plan the budget cut short).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from thinwire.bench.sleeping_stages import capture_gradients, sleep_stages
from thinwire.bench.step_budget import StepCount, agreed_seconds, steps_within
from thinwire.bench.step_phases import StepPhases, engine_split, exchange_alone
from thinwire.bench.traffic import sent_now
from thinwire.parallel import ParallelPlan, parallelize
from thinwire.plan.activations import SavedActivations
from thinwire.plan.plan_traffic import PlanSizes, plan_traffic
from thinwire.plan.stage_profile import StageProfile, for_method, profile_plan
from thinwire.tasks import task


def microbatch_size(config: Any, plan: ParallelPlan) -> int:
    """Sequences per micro-batch: the task's global batch over ``dp * microbatches``."""
    batch = task(config.task, **config.task_options).batch_size
    plan.check_batch(batch)
    return batch // (plan.dp * plan.microbatches)


def profile(
    config: Any, plan: ParallelPlan, shared: dict[tuple, Any] | None = None
) -> list[StageProfile]:
    """Every stage of ``plan`` on the task's model, one micro-batch each. Plans of a sweep
    of the same shape (degrees, micro-batches, sub-batches, stages), whatever their
    schedule, recomputation or data-parallel method, share one profile of the compute
    through ``shared`` (each its own recomputation's passes and its own method's exchange,
    :func:`~thinwire.plan.stage_profile.for_method`): compared side by side, they sleep
    the same compute rather than each its own profile's (which differ by 5-10 % from run
    to run on a shared machine: 4x1x2/mb1/sb2's pipeline slept 1.16 s under PowerSGD and
    1.07 s under DGC in one sweep, each profiled anew)."""
    key = (plan.dp, plan.pp, plan.tp, plan.chunks, plan.microbatches, plan.subbatches,
           plan.stages)  # fmt: skip
    method = (plan.dp_method, tuple(sorted(plan.dp_options.items())))
    if shared is None or key not in shared:
        profiles = profile_plan(
            config.task,
            config.task_options,
            plan,
            microbatch_size(config, plan),
            optimizer=config.optimizer,
            segments=shared is not None and any(p.recompute for p in config.plans),
        )
        if shared is None:
            return profiles
        shared[key] = (method, profiles)
    from thinwire.parallel.layout import read_layout, submodule
    from thinwire.parallel.stages import even_boundaries, stage_ranges

    profiled_for, profiles = shared[key]
    if profiled_for != method:
        profiles = [for_method(p, plan) for p in profiles]
    model = task(config.task, **config.task_options).build_model()
    blocks = len(submodule(model, read_layout(model).blocks))
    ranges = stage_ranges(blocks, plan.stages or even_boundaries(blocks, plan.chunks))
    return [
        p.recomputing(len(ranges[p.index]), plan.recompute[p.index] if plan.recompute else 0.0)
        for p in profiles
    ]


def time_plan(
    rank: int, world: int, config: Any, plan: ParallelPlan, profiles: list[StageProfile]
) -> dict:
    """On every rank: ``config.steps`` sleeping steps under ``plan`` (fewer for a plan over
    ``config.step_budget_s``, as rank 0's first step says); this rank's record."""
    from thinwire.bench.hybrid import optimizer_for, rank_memory

    job = task(config.task, **config.task_options)
    trainer = parallelize(job.build_model(), plan, optimizer=optimizer_for(config, plan))
    inputs, targets = job.global_batch(0)
    saved = SavedActivations(exclude=[p for _, p in trainer.named_parameters()])
    # the schedule's first step also infers shapes (an extra forward on some stages, whose
    # saved tensors the first stage holds through that step): the second real step is the
    # one a sleeping step must match, and the steady state's memory
    capture_gradients(trainer, inputs, targets)
    before = sent_now()
    with saved:
        gradients = capture_gradients(trainer, inputs, targets)
    real = sent_now() - before
    sleepers = sleep_stages(trainer, profiles, gradients)
    phases = StepPhases(trainer)
    seconds, within, between, exchanges, splits, faults = [], [], [], [], [], []
    count = StepCount(config.steps, config.untimed_steps)
    while len(seconds) < count.steps:
        before = sent_now()
        for sleeper in sleepers:
            sleeper.events.clear()
        phases.events.clear()
        phases.faults.clear()
        start = time.perf_counter()
        trainer.step(inputs, targets)
        seconds.append(time.perf_counter() - start)
        sent = sent_now() - before
        within.append(sent.within_host)
        between.append(sent.between_hosts)
        exchanges.append(phases.seconds("X"))
        splits.append(engine_split(trainer))
        faults.append(phases.faults.get("X", 0))
        if len(seconds) == 1 and config.step_budget_s is not None:
            first = agreed_seconds(seconds[0])  # every rank runs rank 0's count
            count = steps_within(first, config.steps, config.untimed_steps, config.step_budget_s)
    timeline = [  # the last step's computes, from its start
        (sleeper.profile.index, kind, begin - start, end - start)
        for sleeper in sleepers
        for kind, begin, end in sleeper.events
    ] + [  # then its exchange and optimizer step (under this rank's first stage)
        (sleepers[0].profile.index, kind, begin - start, end - start)
        for kind, begin, end in phases.events
    ]
    # run again outside the steps: skipped for a plan the budget cut short (a dozen more
    # of its exchanges would take longer than its steps)
    alone = {} if count.shortened else exchange_alone(trainer, phases)
    trainer.close()
    timed = slice(count.untimed, None)
    return {
        "untimed_steps": count.untimed,
        "step_s": statistics.median(seconds[timed]),
        "steps_s": seconds,
        "exchange_s": exchanges,
        "exchange_split_s": splits,
        "exchange_alone_s": alone,
        "exchange_faults": faults,
        "sent_within_host": statistics.mean(within[timed]),
        "sent_between_hosts": statistics.mean(between[timed]),
        "memory": rank_memory(trainer, saved.peak_bytes),
        "real_step_sent": real.within_host + real.between_hosts,
        "timeline": timeline,
    }


def modelled_traffic(
    plan: ParallelPlan, profiles: list[StageProfile], ranks_per_host: int
) -> list[dict[str, float]]:
    """The cost model's bytes per rank per step for ``plan`` with these stage sizes."""
    ordered = sorted(profiles, key=lambda p: p.index)
    sizes = PlanSizes(
        pp=plan.pp,
        dp=plan.dp,
        tp=plan.tp,
        chunks=plan.chunks // plan.pp,
        microbatches=plan.microbatches,
        tp_allreduce_bytes=[p.tp_allreduce_bytes for p in ordered],
        activation_bytes=[p.activation_bytes for p in ordered],
        dp_bytes=[p.dp_sent_bytes for p in ordered],
    )
    return plan_traffic(sizes, ranks_per_host)


def sleeping_record(
    config: Any, plan: ParallelPlan, profiles: list[StageProfile], results: list[dict]
) -> dict:
    """The plan's record from every rank's: step time, tokens per second, bytes per rank
    measured and modelled, memory per rank, the profiled compute."""
    from thinwire.parallel.plan_spec import plan_label

    job = task(config.task, **config.task_options)
    tokens = job.batch_size * job.seq_len
    step_s = results[0]["step_s"]
    untimed = results[0]["untimed_steps"]  # the same on every rank
    per_host = config.ranks_per_host if config.network == "emulated" else plan.world_size
    modelled = modelled_traffic(plan, profiles, per_host)
    return {
        "plan": plan_label(plan),
        "degrees": {"dp": plan.dp, "pp": plan.pp, "tp": plan.tp},
        "compute": "sleep",
        "step_s": step_s,
        "steps_s": results[0]["steps_s"],
        "untimed_steps": untimed,
        "tokens_per_s": tokens / step_s,
        "stage_compute_s": [
            {
                "stage": p.index,
                "forward": p.forward_s,
                "backward": p.backward_s,
                "recompute": p.recompute_s,
            }
            for p in sorted(profiles, key=lambda p: p.index)
        ],
        "sent_per_rank": [
            {"within_host": r["sent_within_host"], "between_hosts": r["sent_between_hosts"]}
            for r in results
        ],
        "modelled_per_rank": modelled,
        "sent_between_hosts": sum(r["sent_between_hosts"] for r in results),
        "modelled_between_hosts": sum(m["between_hosts"] for m in modelled),
        "sent_within_host": sum(r["sent_within_host"] for r in results),
        "modelled_within_host": sum(m["within_host"] for m in modelled),
        "real_forward_backward_sent": sum(r.get("real_step_sent", 0) for r in results),
        "memory_per_rank": [r["memory"] for r in results],
        "peak_memory_bytes": max(r["memory"]["total"] for r in results),
        "timelines": [r.get("timeline", []) for r in results],
        "exchange_s_per_rank": [  # inside the timed steps, median; then alone
            statistics.median(r["exchange_s"][untimed:]) for r in results
        ],
        "exchange_split_s_per_rank": [  # the engine's compress and communicate, medians
            [statistics.median(part[untimed:]) for part in zip(*r["exchange_split_s"], strict=True)]
            for r in results
        ],
        "exchange_alone_s_per_rank": [r["exchange_alone_s"] for r in results],
        "exchange_faults_per_rank": [  # minor page faults during the exchange, median
            statistics.median(r["exchange_faults"][untimed:]) for r in results
        ],
    }


def plot_throughput(records: list[dict], path: Any, title: str = "") -> Any:
    """Tokens per second of each plan (bars), labelled with the bytes each step sent
    between hosts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.45 * len(records) + 1.5))
    labels = [r["plan"] for r in records]
    values = [r["tokens_per_s"] for r in records]
    bars = ax.barh(labels, values, color="tab:blue")
    for bar, record in zip(bars, records, strict=True):
        ax.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {record['sent_between_hosts'] / 1e6:.1f} MB between hosts",
            va="center",
            fontsize=7,
        )
    ax.invert_yaxis()
    ax.set_xlim(0, 1.45 * max(values))
    ax.set_xlabel("tokens per second (virtual accelerators)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
