"""The step time of a hybrid plan on measured links: pure functions over numbers.

Inputs: per pipeline stage what one of its ranks computes per micro-batch and which
collectives it issues (:class:`StageCost`, from the stage profiler), the plan's degrees
and schedule, and the links ``thinwire probe`` measured (:class:`thinwire.plan.probe.
LinkProbe`). Nothing is fitted to the step times it predicts. A step, as
:class:`thinwire.parallel.trainer.ParallelTrainer` runs it:

1. **The pipeline** (:mod:`thinwire.plan.schedule_sim`): every micro-batch's forward and
   backward on every stage, each with its tensor-parallel all-reduces on the link the
   ``"tp"`` group spans (the probe's all-reduce fit for that group size), and the
   activations and their gradients between stages as gloo sends them (the probe's
   point-to-point fit; what leaves a host at once shares its uplink).
2. **The data-parallel exchange**, per stage once its pipeline work is done: the
   strategy's buckets (:class:`thinwire.plan.cost.MethodCost`, measured through the real
   engine) on the link the ``"dp"`` group spans, shared by the groups of a host that cross
   at once; after ``backward()`` (the optimizer wrapper), so nothing overlaps it. Its
   compression is CPU work, slowed by the probe's CPU sharing.
3. **The optimizer step** (measured alone, slowed the same way) and the loss's all-reduce.

The step is the last stage to finish. :class:`PlanPrediction` breaks it down.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import TypeVar

from thinwire.parallel.interleaved_program import held_in_turn
from thinwire.parallel.plan import CHUNKS_PER_RANK
from thinwire.plan.cost import MethodCost, round_exchange_s
from thinwire.plan.cpu_sharing import shared_finish, slowdown_curve
from thinwire.plan.fluid_wire import way
from thinwire.plan.network import GLOO_STEP_DELAYS, Link
from thinwire.plan.plan_traffic import rank_at
from thinwire.plan.probe import Fit, LinkProbe, PointToPoint
from thinwire.plan.schedule_sim import Message, StageTimes
from thinwire.plan.shared_links import in_turn_for, simulate_shared
from thinwire.plan.turns import TurnPass, in_turns_s


@dataclass(frozen=True)
class StageCost:
    """What one rank of a stage does per step, as profiled (one micro-batch, one chunk)."""

    forward_s: float
    """Compute of one micro-batch's forward pass (the collectives' time excluded)."""
    backward_s: float
    forward_allreduces: tuple[int, ...] = ()
    """Bytes of each tensor-parallel all-reduce in the forward pass."""
    backward_allreduces: tuple[int, ...] = ()
    activation_bytes: int = 0
    """What it sends the next stage per micro-batch (the gradient back is the same)."""
    dp_cost: MethodCost | None = None
    """Its data-parallel exchange per step (``None``: ``dp = 1``)."""
    optimizer_s: float = 0.0
    """The optimizer step over its shard, alone on a core."""
    parameter_bytes: int = 0
    """Its parameter shards (their gradients are as large)."""
    optimizer_state_bytes: int = 0
    exchange_bytes: int = 0
    """The data-parallel exchange's state (residuals, warm starts)."""
    saved_bytes: int = 0
    """What one micro-batch's forward saves for the backward pass (of a checkpointed
    segment, only its input)."""
    recompute_s: float = 0.0
    """Compute of one micro-batch's recomputation (its checkpointed blocks' forward)."""
    recompute_allreduces: tuple[int, ...] = ()
    """Bytes of each tensor-parallel all-reduce the recomputation repeats."""
    rebuilt_bytes: int = 0
    """What a recomputation saves again (its input included): held for one micro-batch,
    from its recomputation to its backward."""
    segment_input_bytes: int = 0
    """The checkpointed segment's input per micro-batch (kept; the rebuilt graph holds it
    again, counted once)."""
    after_segment_bytes: int = 0
    """What the parts after the segment save (the head and loss, on the last stage),
    freed by their backward before the segment is recomputed."""
    subbatches: int = 1
    """Sub-batches per micro-batch, taking turns (:mod:`thinwire.plan.turns`)."""
    turns: tuple[TurnPass, TurnPass, TurnPass] | None = None
    """With sub-batches: one sub-batch's forward, backward (the loss's all-reduces apart)
    and recomputation, in the order the turns run them."""
    loss_allreduces: tuple[int, ...] = ()
    """Bytes of the vocabulary-parallel loss's all-reduces (counted in
    :attr:`backward_allreduces` too), run once per micro-batch."""

    def with_compute(self, forward_s: float, backward_s: float, recompute_s: float) -> StageCost:
        """This stage computing ``forward_s``, ``backward_s`` and ``recompute_s`` per
        micro-batch instead (the sub-batches' passes scaled alike)."""
        turns = self.turns
        if turns is not None:
            wanted = (forward_s, backward_s, recompute_s)
            had = (self.forward_s, self.backward_s, self.recompute_s)
            turns = tuple(  # type: ignore[assignment]
                one.scaled(want / have if have else 1.0)
                for one, want, have in zip(turns, wanted, had, strict=True)
            )
        return replace(
            self, forward_s=forward_s, backward_s=backward_s, recompute_s=recompute_s, turns=turns
        )

    def pass_times(
        self, allreduce: Callable[[int], tuple[float, float]], at_once: int | None = None
    ) -> tuple[float, float, float]:
        """One micro-batch's forward, backward and recomputation, all-reduces included
        (one of ``b`` bytes takes ``sum(allreduce(b))``: its latency and its time on the
        wire): one after another, or with sub-batches overlapping them in turns, at most
        ``at_once`` in flight (the group's limit; ``None``: none)."""

        def allreduce_s(nbytes: int) -> float:
            return sum(allreduce(nbytes))

        if self.turns is None or self.subbatches == 1:
            return (
                self.forward_s + sum(map(allreduce_s, self.forward_allreduces)),
                self.backward_s + sum(map(allreduce_s, self.backward_allreduces)),
                self.recompute_s + sum(map(allreduce_s, self.recompute_allreduces)),
            )
        forward, backward, recompute = (
            in_turns_s(one, self.subbatches, allreduce, at_once) for one in self.turns
        )
        loss = sum(map(allreduce_s, self.loss_allreduces))
        return forward, backward + loss, recompute if self.recompute_s else 0.0

    def memory(self, in_flight: int) -> dict[str, int]:
        """Bytes one rank of this stage holds with ``in_flight`` micro-batches' activations
        (and, with recomputation, one micro-batch's rebuilt ones)."""
        held = {
            "parameters": self.parameter_bytes,
            "gradients": self.parameter_bytes,
            "optimizer": self.optimizer_state_bytes,
            "exchange": self.exchange_bytes,
            "activations": self.activation_peak(in_flight),
        }
        return {**held, "total": sum(held.values())}

    def activation_peak(self, in_flight: int) -> int:
        """The most bytes of saved activations with ``in_flight`` micro-batches held: at the
        end of the last forward, or while one of them is recomputed (inside its backward
        on the last stage, after the head's; every schedule recomputes there so)."""
        held = self.saved_bytes * in_flight
        if not (self.rebuilt_bytes and in_flight):
            return held
        released = self.segment_input_bytes + self.after_segment_bytes
        return max(held, held - released + self.rebuilt_bytes)


@dataclass(frozen=True)
class PlanPrediction:
    """A plan's predicted step, and where its time goes (the critical stage's view)."""

    step_s: float
    pipeline_s: float
    """The schedule's makespan: forward and backward of every micro-batch."""
    compute_s: float
    """The busiest stage's compute in the pipeline (tensor-parallel all-reduces excluded)."""
    tensor_s: float
    """The busiest stage's tensor-parallel all-reduces."""
    bubble_s: float
    """The pipeline's idle and point-to-point waiting, on the busiest stage."""
    data_parallel_s: float
    """The slowest stage's exchange (and compression) after the pipeline."""
    optimizer_s: float
    stage_end_s: tuple[float, ...]
    memory: tuple[dict[str, int], ...] = ()
    """Per pipeline rank, what each rank there holds (:meth:`StageCost.memory` of its
    stage, or of its two stages together under interleaved 1F1B)."""
    recompute_s: float = 0.0
    """The busiest stage's recomputation (its collectives included)."""
    timeline: tuple[tuple[int, str, int, float, float], ...] = ()
    """The simulated pipeline's computes (:attr:`PipelineTimes.timeline`)."""

    @property
    def peak_memory_bytes(self) -> int:
        """The most any rank holds."""
        return max((m["total"] for m in self.memory), default=0)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready figures."""
        return {
            "step_s": self.step_s,
            "pipeline_s": self.pipeline_s,
            "compute_s": self.compute_s,
            "recompute_s": self.recompute_s,
            "tensor_s": self.tensor_s,
            "bubble_s": self.bubble_s,
            "data_parallel_s": self.data_parallel_s,
            "optimizer_s": self.optimizer_s,
            "stage_end_s": list(self.stage_end_s),
            "memory": [dict(m) for m in self.memory],
            "peak_memory_bytes": self.peak_memory_bytes,
        }


@dataclass(frozen=True)
class Degrees:
    """A plan's shape: degrees, micro-batches, schedule (a :class:`thinwire.ParallelPlan`
    has all of these)."""

    dp: int
    pp: int
    tp: int
    microbatches: int = 1
    schedule: str = "1f1b"


def fitted_link(fit: Fit) -> Link:
    """A :class:`Link` whose ring collectives cost what ``fit`` measured."""
    return Link(
        bandwidth_bps=fit.bandwidth_bps,
        latency_s=fit.alpha_s / GLOO_STEP_DELAYS,
        header_bytes=0,
        store_and_forward=False,
    )


def _between(low: float, high: float, at: int, top: int) -> float:
    return low if top <= 1 else low + (high - low) * (min(at, top) - 1) / (top - 1)


_Measured = TypeVar("_Measured", Fit, PointToPoint)


def _at_count(measured: dict[int, _Measured], count: int) -> _Measured:
    """The probe's figures for ``count`` flows at once: measured, or linear between the
    fewest and the most it measured (each field in seconds or bytes)."""
    if count in measured:
        return measured[count]
    low, top = measured[min(measured)], max(measured)
    high = measured[top]
    between = {
        f.name: _between(getattr(low, f.name), getattr(high, f.name), count, top)
        for f in fields(low)
        if f.name.endswith(("_s", "_bytes"))
    }
    extra = {"pairs": count} if isinstance(low, PointToPoint) else {}
    return replace(low, samples=(), **between, **extra)


def shared_fit(fits: dict[int, Fit], count: int) -> Fit:
    """The all-reduce fit with ``count`` groups at once, between the probe's (one, all)."""
    return _at_count(fits, count)


def shared_p2p(probe: LinkProbe, pairs: int) -> PointToPoint:
    """Point-to-point between hosts with ``pairs`` pairs crossing at once."""
    fits = {p.pairs: p for p in probe.point_to_point}
    if not fits:
        raise ValueError("the probe ran on one host: it has no link between hosts")
    return _at_count(fits, pairs)


class PlanOnLinks:
    """Where a plan's groups run on the probed cluster, and what their traffic costs."""

    def __init__(self, degrees: Degrees, probe: LinkProbe) -> None:
        world = degrees.dp * degrees.pp * degrees.tp
        if world != probe.hosts * probe.ranks_per_host:
            raise ValueError(
                f"the plan needs {world} ranks; the probe measured {probe.hosts} host(s) x "
                f"{probe.ranks_per_host}: plan for the cluster the probe ran on"
            )
        self.degrees, self.probe = degrees, probe
        self._per_host: int | None = None
        self._tp_parts: dict[int, tuple[float, float]] = {}  # by size: asked per layer

    def host(self, rank: int) -> int:
        """The host of ``rank`` (torchrun's numbering)."""
        return rank // self.probe.ranks_per_host

    def tp_allreduce_s(self, nbytes: int) -> float:
        """One tensor-parallel all-reduce of ``nbytes`` (the group inside a host when it
        fits there: every host's groups run at once)."""
        return sum(self.tp_allreduce_parts(nbytes))

    def tp_allreduce_parts(self, nbytes: int) -> tuple[float, float]:
        """:meth:`tp_allreduce_s` in two parts: what all-reduces in flight together
        overlap (the share of the ring's latency the probe saw hidden at that size,
        :meth:`~thinwire.plan.probe.Fit.overlap_at`),
        and what they take one after another (their bytes on the wire, the rest)."""
        tp = self.degrees.tp
        if tp == 1 or nbytes == 0:
            return 0.0, 0.0
        if nbytes in self._tp_parts:
            return self._tp_parts[nbytes]
        group = [rank_at(0, 0, t, self.degrees) for t in range(tp)]
        if len({self.host(r) for r in group}) == 1 and tp in self.probe.intra_allreduce:
            fit = self.probe.intra_allreduce[tp]
        else:
            fit = shared_fit(self.probe.inter_allreduce, self.probe.ranks_per_host)
        latency = 2 * (tp - 1) * fit.alpha_s
        wire = 2 * (tp - 1) / tp * nbytes * fit.beta_s
        hidden = fit.overlap_at(nbytes)
        parts = self._tp_parts[nbytes] = (hidden * latency, wire + (1 - hidden) * latency)
        return parts

    def replicas(self) -> list[tuple[int, int]]:
        """The pipelines side by side: one per (data-parallel, tensor-parallel) index."""
        return [(i, t) for i in range(self.degrees.dp) for t in range(self.degrees.tp)]

    def message(self, boundary: int, nbytes: int) -> tuple[Message, list[object]]:
        """One micro-batch's message across ``boundary`` (stage ``b`` to ``b + 1``), with
        the link it has to itself, and per replica the link it crosses on, named by its two
        hosts (what leaves one host shares its uplink: :func:`thinwire.plan.fluid_wire.way`);
        within a host each pair of ranks has its own."""
        d = self.degrees  # stage s on pipeline rank s % pp (two stages a rank: interleaved)
        ends = [
            (
                self.host(rank_at(boundary % d.pp, i, t, d)),
                self.host(rank_at((boundary + 1) % d.pp, i, t, d)),
            )
            for i, t in self.replicas()
        ]
        if all(a == b for a, b in ends):
            fit = self.probe.intra_allreduce.get(2) or next(
                iter(self.probe.intra_allreduce.values())
            )
            return Message(nbytes * fit.beta_s, fit.alpha_s, float(nbytes)), list(range(len(ends)))
        link = shared_p2p(self.probe, 1)
        message = Message(
            nbytes * link.beta_s, link.latency_s, min(nbytes, link.buffer_bytes) * link.beta_s
        )
        return message, [pair if pair[0] != pair[1] else k for k, pair in enumerate(ends)]

    def dp_link(self, stage: int) -> tuple[Link, int]:
        """The link one data-parallel group of ``stage`` runs on, and the group's size."""
        d = self.degrees
        groups = [[rank_at(stage % d.pp, i, t, d) for i in range(d.dp)] for t in range(d.tp)]
        spanning = [g for g in groups if len({self.host(r) for r in g}) > 1]
        if not spanning:
            intra = self.probe.intra_allreduce  # by group size; else the largest probed
            return fitted_link(intra.get(d.dp) or intra[max(intra)]), d.dp
        per_host = self._spanning_per_host()
        return fitted_link(shared_fit(self.probe.inter_allreduce, per_host)), d.dp

    def _spanning_per_host(self) -> int:
        """The most data-parallel groups crossing between hosts that touch one host: every
        stage's groups exchange at about the same time, after the pipeline."""
        if self._per_host is None:
            d, touching = self.degrees, Counter[int]()
            for stage in range(d.pp):
                for t in range(d.tp):
                    hosts = {self.host(rank_at(stage, i, t, d)) for i in range(d.dp)}
                    if len(hosts) > 1:
                        touching.update(hosts)
            self._per_host = max(touching.values(), default=1)
        return self._per_host


def largest_sharing_group(replicas: int, links: Sequence[Sequence[object]]) -> list[int]:
    """The largest set of replicas that share links, directly or through each other
    (``links[b][r]``: the link replica ``r`` crosses boundary ``b`` on; two share it where
    their messages, either way, queue for the same thing at any boundary, as
    :func:`~thinwire.plan.fluid_wire.way` says: a host's uplink). Other sets run the same
    schedule on links of their own, so simulating one tells the step of all: a 1024-rank
    plan simulates a few pipelines, not hundreds."""
    parent = list(range(replicas))

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    first: dict[object, int] = {}  # each queue's first replica
    for per_replica in links:
        for replica, link in enumerate(per_replica):
            for queue in {way(link, 0, 0, True), way(link, 0, 0, False)}:
                if queue in first:
                    parent[root(replica)] = root(first[queue])
                else:
                    first[queue] = replica
    groups: dict[int, list[int]] = {}
    for replica in range(replicas):
        groups.setdefault(root(replica), []).append(replica)
    return max(groups.values(), key=len)


def predict_plan(degrees: Degrees, stages: Sequence[StageCost], probe: LinkProbe) -> PlanPrediction:
    """One step of a plan whose pipeline stages cost ``stages`` on the probed cluster (two
    stages a pipeline rank under interleaved 1F1B, stage ``s`` on rank ``s % pp``)."""
    pp = degrees.pp
    count = pp * CHUNKS_PER_RANK.get(degrees.schedule, 1)
    if len(stages) != count:
        raise ValueError(
            f"pp={pp} with {degrees.schedule} needs a cost per stage ({count}), got {len(stages)}"
        )
    links = PlanOnLinks(degrees, probe)
    times = [
        StageTimes(*s.pass_times(links.tp_allreduce_parts, links.probe.collectives_at_once))
        for s in stages
    ]
    # the all-reduces' time the passes wait for (sub-batches hide some of it)
    tensor = [
        t.forward_s + t.backward_s - s.forward_s - s.backward_s
        for s, t in zip(stages, times, strict=True)
    ]
    crossings = [links.message(b, stages[b].activation_bytes) for b in range(count - 1)]
    messages = [message for message, _ in crossings]
    pipelines = links.replicas()
    sharing = largest_sharing_group(len(pipelines), [per_replica for _, per_replica in crossings])
    same_replica: dict[int, list[int]] = {}
    for position, replica in enumerate(sharing):  # a stage's tensor-parallel ranks together
        same_replica.setdefault(pipelines[replica][0], []).append(position)
    pipeline = simulate_shared(
        in_turn_for(probe, [s.activation_bytes for s in stages[:-1]]),
        schedule=degrees.schedule,
        microbatches=degrees.microbatches,
        stages=times,
        forward=messages,
        backward=messages,
        replicas=len(sharing),
        links=[[per_replica[r] for r in sharing] for _, per_replica in crossings],
        together=[group for group in same_replica.values() if len(group) > 1],
    )
    held = [range(k, count, pp) for k in range(pp)]  # each rank's stages
    # per pipeline rank: the exchange's time on the wire; its compression and the optimizer
    # step, CPU work timed alone
    comm, compress, optimizer = [0.0] * pp, [0.0] * pp, [0.0] * pp
    for index, stage in enumerate(stages):
        if stage.dp_cost is not None and degrees.dp > 1:
            link, size = links.dp_link(index)
            if stage.dp_cost.schedule == "local":  # DiLoCo, local SGD: once per round
                comm[index % pp] += round_exchange_s(stage.dp_cost, link, size, pipeline.step_s)
            else:
                comm[index % pp] += stage.dp_cost.comm_time(size, link)
                compress[index % pp] += stage.dp_cost.compress_s
        optimizer[index % pp] += stage.optimizer_s
    # the stages' CPU work after the pipeline, sharing the CPU with whatever else runs then
    slowdown = slowdown_curve(
        probe.cpu_slowdowns, probe.hosts * probe.ranks_per_host, probe.cpu_slowdown
    )
    starts = [pipeline.stage_end_s[k] + comm[k] for k in range(pp)]
    work = [compress[k] + optimizer[k] for k in range(pp)]
    ends = shared_finish(starts, work, [degrees.dp * degrees.tp] * pp, slowdown)
    stretch = [(ends[k] - starts[k]) / work[k] if work[k] > 0 else 1.0 for k in range(pp)]
    exchange = [comm[k] + compress[k] * stretch[k] for k in range(pp)]
    optimizer = [optimizer[k] * stretch[k] for k in range(pp)]
    loss = 2 * shared_fit(probe.inter_allreduce or probe.intra_allreduce, 1).alpha_s
    busiest = held[max(range(pp), key=lambda k: pipeline.stage_busy_s[k])]
    m = degrees.microbatches
    compute = m * sum(stages[s].forward_s + stages[s].backward_s for s in busiest)
    recompute = m * sum(times[s].recompute_s for s in busiest)
    tensor_s = m * sum(tensor[s] for s in busiest)
    memory = []
    for k, stage_indices in enumerate(held):
        parts = [stages[s].memory(pipeline.peak_in_flight[s]) for s in stage_indices]
        together = {key: sum(part[key] for part in parts) for key in parts[0]}
        if len(parts) > 1:  # two stages' activations peak at different times
            together["activations"] = max(
                sum(stages[s].activation_peak(n) for s, n in counts.items())
                for counts in held_in_turn(k, pp, m)
            )
            together["total"] = sum(v for key, v in together.items() if key != "total")
        memory.append(together)
    return PlanPrediction(
        step_s=max(ends) + loss,
        pipeline_s=pipeline.step_s,
        compute_s=compute,
        tensor_s=tensor_s,
        bubble_s=max(0.0, pipeline.step_s - compute - recompute - tensor_s),
        data_parallel_s=max(exchange),
        optimizer_s=max(optimizer),
        stage_end_s=tuple(ends),
        memory=tuple(memory),
        recompute_s=recompute,
        timeline=pipeline.timeline,
    )
