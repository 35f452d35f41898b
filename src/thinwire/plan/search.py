"""The planner's search: every plan of a cluster, its stages cut by dynamic programming,
predicted on the probed links, ranked under a memory limit.

The space (:func:`shapes`): degrees ``dp x pp x tp`` whose product is the world, tensor
parallelism kept inside a host (its all-reduces run per layer: only fast links can carry
them), no more stages than blocks; micro-batches from :attr:`SearchSpace.microbatches`
that split the global batch evenly; GPipe, and 1F1B and shifted 1F1B where they apply
(``m >= pp``), and interleaved 1F1B (two stages a rank, ``m`` a multiple of ``pp``, at
least ``2 pp`` blocks; each stage checked against the limit in the split, each rank's two
stages together in the prediction; not offered recomputation); the data-parallel method
among :attr:`SearchSpace.methods` (only dense without data parallelism). For each,
:func:`thinwire.plan.split.best_split` cuts the stages (Alpa's objective, every stage
within the limit); where no split fits, each stage of the fastest split recomputes the
least of its blocks that brings it under the limit (Merak's stage-aware recomputation;
shifted 1F1B is searched only then, since without recomputation it is 1F1B);
:func:`thinwire.plan.hybrid_cost.predict_plan` predicts the step and the memory of every
rank. Plans that fit are ranked by predicted step; those that do not, by how far over
they are.

Everything here is arithmetic on profiles (:class:`thinwire.plan.model_costs.ModelCosts`)
and a probe: no process is started and nothing is measured.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from thinwire.parallel.interleaved_program import INTERLEAVED
from thinwire.parallel.plan import CHUNKS_PER_RANK, ParallelPlan
from thinwire.parallel.plan_spec import plan_label
from thinwire.plan.hybrid_cost import Degrees, PlanOnLinks, PlanPrediction, StageCost, predict_plan
from thinwire.plan.model_costs import Method, ModelCosts
from thinwire.plan.probe import LinkProbe
from thinwire.plan.recompute_choice import least_ratios
from thinwire.plan.split import PartCost, Split, best_split, in_flight

#: the data-parallel methods searched by default
DEFAULT_METHODS: tuple[Method, ...] = (
    ("dense", {}),
    ("powersgd", {"rank": 4}),
    ("dgc", {"density": 0.01, "momentum": 0.0}),  # thinwire applies no momentum under AdamW
)


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose besides the degrees."""

    microbatches: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "shifted-1f1b", INTERLEAVED)
    methods: tuple[Method, ...] = DEFAULT_METHODS
    recompute: bool = True
    """Whether a plan over the memory limit may recompute (each stage the least of its
    blocks that fits: :mod:`thinwire.plan.recompute_choice`)."""
    subbatches: tuple[int, ...] = (1, 2)
    """Sub-batches per micro-batch tried for plans with ``tp > 1`` (each micro-batch's
    tensor-parallel all-reduces overlapping compute: :mod:`thinwire.parallel.subpipeline`)."""


@dataclass(frozen=True)
class Shape:
    """A plan before its stages are cut."""

    dp: int
    pp: int
    tp: int
    microbatches: int
    schedule: str
    method: Method
    subbatches: int = 1

    def microbatch_size(self, batch: int) -> int:
        """Sequences per micro-batch when each data-parallel rank takes its slice."""
        return batch // (self.dp * self.microbatches)

    def plan(
        self, stages: tuple[int, ...] | None = None, recompute: tuple[float, ...] | None = None
    ) -> ParallelPlan:
        """The :class:`ParallelPlan` of this shape with ``stages`` cut there, recomputing
        ``recompute`` of each stage's blocks."""
        name, options = self.method
        return ParallelPlan(
            dp=self.dp, pp=self.pp, tp=self.tp, microbatches=self.microbatches,
            schedule=self.schedule, stages=stages or None, recompute=recompute,
            subbatches=self.subbatches, dp_method=name, dp_options=dict(options),
        )  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shapes(
    world: int, ranks_per_host: int, blocks: int, batch: int, space: SearchSpace = SearchSpace()
) -> tuple[list[Shape], list[tuple[str, str]]]:
    """Every shape of the space on ``world`` ranks, and the ``(plan, reason)`` of each
    combination of degrees and micro-batches left out."""
    kept, refused = [], []
    for tp in _divisors(ranks_per_host):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            degrees = f"{dp}x{pp}x{tp}"
            if pp > blocks:
                refused.append((degrees, f"{pp} stages but only {blocks} blocks"))
                continue
            for m in space.microbatches:
                if batch % (dp * m):
                    refused.append(
                        (f"{degrees}/mb{m}", f"batch {batch} does not split into {dp} x {m}")
                    )
                    continue
                schedules = ["1f1b"] if pp == 1 else space.schedules
                if not space.recompute:  # shifted 1F1B only differs where it recomputes
                    schedules = [s for s in schedules if s != "shifted-1f1b"]
                for schedule in schedules:
                    if schedule in ("1f1b", "shifted-1f1b") and pp > 1 and m < pp:
                        continue  # 1F1B with fewer micro-batches than stages is GPipe
                    if schedule == INTERLEAVED and (m % pp or 2 * pp > blocks):
                        continue  # rounds of pp micro-batches; two chunks a rank
                    for method in space.methods if dp > 1 else [("dense", {})]:
                        for parts in space.subbatches if tp > 1 else (1,):
                            if (batch // (dp * m)) % parts:
                                continue  # micro-batches too small to split so
                            kept.append(Shape(dp, pp, tp, m, schedule, method, parts))
    return kept, refused


def needs(
    found: Iterable[Shape], batch: int
) -> dict[int, tuple[list[int], list[tuple[int, Method]]]]:
    """Per ``tp``, the micro-batch sizes and ``(dp, method)`` exchanges to profile."""
    sizes: dict[int, set[int]] = {}
    exchanges: dict[int, dict[tuple, tuple[int, Method]]] = {}
    for shape in found:
        sizes.setdefault(shape.tp, set()).add(shape.microbatch_size(batch) // shape.subbatches)
        wanted = exchanges.setdefault(shape.tp, {})
        if shape.dp > 1:
            name, options = shape.method
            wanted[(shape.dp, name, tuple(sorted(options.items())))] = (shape.dp, shape.method)
    return {tp: (sorted(sizes[tp]), list(exchanges[tp].values())) for tp in sizes}


@dataclass(frozen=True)
class Evaluated:
    """A plan and what the planner predicts of it."""

    plan: ParallelPlan
    prediction: PlanPrediction
    over_bytes: int
    """How far the fullest rank is over the memory limit (``<= 0``: it fits)."""

    @property
    def fits(self) -> bool:
        """Whether every rank fits in the limit."""
        return self.over_bytes <= 0

    @property
    def label(self) -> str:
        """The plan as ``thinwire bench --plans`` writes it."""
        return plan_label(self.plan)


@dataclass(frozen=True)
class Prepared:
    """A shape with its stages cut and costed: predicted again on other links at once."""

    plan: ParallelPlan
    stages: tuple[StageCost, ...]


@dataclass(frozen=True)
class SearchResult:
    """The search's answer: plans that fit (fastest first), plans over the memory limit
    (least over first), combinations left out with why, and the search's own time."""

    ranked: tuple[Evaluated, ...]
    too_large: tuple[Evaluated, ...]
    refused: tuple[tuple[str, str], ...]
    prepared: tuple[Prepared, ...]
    memory_limit: int | None
    seconds: float

    @property
    def chosen(self) -> Evaluated:
        """The fastest plan that fits."""
        if not self.ranked:
            least = self.too_large[0] if self.too_large else None
            extra = (
                f"; the smallest, {least.label}, needs {_gib(least.prediction.peak_memory_bytes)}"
                if least
                else ""
            )
            raise ValueError(
                f"no plan fits in {_gib(self.memory_limit or 0)} per rank{extra}: raise the "
                "memory limit, add ranks, or train with smaller micro-batches"
            )
        return self.ranked[0]


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _part_costs(
    costs: ModelCosts, shape: Shape, links: PlanOnLinks
) -> tuple[PartCost, list[PartCost], PartCost]:
    """The embedding, each block and the head as the split sees them."""
    mb = shape.microbatch_size(costs.batch_size)

    def part(blocks: range, first: bool = False, last: bool = False) -> PartCost:
        stage = costs.stage(
            shape.tp, mb, shape.dp, shape.method, blocks, first=first, last=last,
            subbatches=shape.subbatches,
        )  # fmt: skip
        forward, backward, _ = stage.pass_times(
            links.tp_allreduce_parts, links.probe.collectives_at_once
        )
        return PartCost(forward + backward, stage.memory(0)["total"], stage.saved_bytes)

    first = part(range(0), first=True)
    blocks = [part(range(i, i + 1)) for i in range(costs.blocks)]
    return first, blocks, part(range(costs.blocks, costs.blocks), last=True)


def prepare(
    costs: ModelCosts, shape: Shape, probe: LinkProbe, memory_limit: int | None,
    recompute: bool = False, parts: dict | None = None,
) -> Prepared | None:  # fmt: skip
    """``shape`` with its stages cut (the best split within ``memory_limit``, or the
    fastest if none fits) and each stage's cost. With ``recompute``, a split over the limit
    recomputes instead, each stage the least that fits. ``None`` for a shifted 1F1B that
    needs no recomputation (it is 1F1B)."""
    degrees = Degrees(shape.dp, shape.pp, shape.tp, shape.microbatches, shape.schedule)
    links = PlanOnLinks(degrees, probe)
    # the parts cost the same whatever the schedule: shapes that differ only there share them
    key = (shape.dp, shape.tp, shape.microbatches, repr(shape.method), shape.subbatches)
    found = parts.get(key) if parts is not None else None
    if found is None:
        found = _part_costs(costs, shape, links)
        if parts is not None:
            parts[key] = found
    first, blocks, last = found
    count = shape.pp * CHUNKS_PER_RANK[shape.schedule]  # stages, two a rank if interleaved
    split: Split | None = best_split(
        first, blocks, last, count, shape.schedule, shape.microbatches, memory_limit
    )
    fits = split is not None
    if split is None:
        split = best_split(first, blocks, last, count, shape.schedule, shape.microbatches)
    assert split is not None
    edges = [0, *split.boundaries, costs.blocks]
    ranges = [range(edges[s], edges[s + 1]) for s in range(count)]
    ratios = None
    # (not for interleaved plans: a rank's two stages share its memory, which the choice
    # of each stage's ratio alone does not see)
    if recompute and not fits and memory_limit is not None and shape.schedule != INTERLEAVED:
        ratios = _least_ratios(costs, shape, ranges, memory_limit)
    if shape.schedule == "shifted-1f1b" and ratios is None:
        return None
    return Prepared(
        shape.plan(split.boundaries, ratios), _stage_costs(costs, shape, ranges, ratios)
    )


def _stage_costs(
    costs: ModelCosts, shape: Shape, ranges: list[range], ratios: tuple[float, ...] | None
) -> tuple[StageCost, ...]:
    mb = shape.microbatch_size(costs.batch_size)
    return tuple(
        costs.stage(
            shape.tp, mb, shape.dp, shape.method, kept, first=s == 0,
            last=s == len(ranges) - 1, recompute=ratios[s] if ratios else 0.0,
            subbatches=shape.subbatches,
        )
        for s, kept in enumerate(ranges)
    )  # fmt: skip


def _least_ratios(
    costs: ModelCosts, shape: Shape, ranges: list[range], memory_limit: int
) -> tuple[float, ...] | None:
    """Per stage, the least recomputation that brings it under ``memory_limit``."""
    mb = shape.microbatch_size(costs.batch_size)

    def held(s: int, ratio: float) -> int:
        stage = costs.stage(
            shape.tp, mb, shape.dp, shape.method, ranges[s], first=s == 0,
            last=s == shape.pp - 1, recompute=ratio, subbatches=shape.subbatches,
        )  # fmt: skip
        return stage.memory(in_flight(shape.schedule, s, shape.pp, shape.microbatches))["total"]

    ratios = least_ratios(held, [len(r) for r in ranges], memory_limit)
    return ratios if ratios and any(ratios) else None


def evaluate(prepared: Prepared, probe: LinkProbe, memory_limit: int | None) -> Evaluated:
    """The prediction of a prepared plan on ``probe``'s links."""
    plan = prepared.plan
    degrees = Degrees(plan.dp, plan.pp, plan.tp, plan.microbatches, plan.schedule)
    prediction = predict_plan(degrees, prepared.stages, probe)
    over = 0 if memory_limit is None else prediction.peak_memory_bytes - memory_limit
    return Evaluated(plan, prediction, over)


def rank(
    prepared: Iterable[Prepared], probe: LinkProbe, memory_limit: int | None
) -> tuple[list[Evaluated], list[Evaluated]]:
    """Every prepared plan predicted: those that fit, fastest first; the others, least
    over the limit first."""
    evaluated = [evaluate(p, probe, memory_limit) for p in prepared]
    fitting = sorted((e for e in evaluated if e.fits), key=lambda e: e.prediction.step_s)
    over = sorted((e for e in evaluated if not e.fits), key=lambda e: e.over_bytes)
    return fitting, over


def search(
    costs: ModelCosts,
    probe: LinkProbe,
    memory_limit: int | None = None,
    space: SearchSpace = SearchSpace(),
) -> SearchResult:
    """Every plan of the probed cluster for the profiled model, ranked."""
    start = time.perf_counter()
    world = probe.hosts * probe.ranks_per_host
    found, refused = shapes(world, probe.ranks_per_host, costs.blocks, costs.batch_size, space)
    usable = []
    for shape in found:
        if shape.tp in costs.refused:
            refused.append((f"tp={shape.tp}", costs.refused[shape.tp]))
        else:
            usable.append(shape)
    refused = list(dict.fromkeys(refused))
    parts: dict = {}
    prepared = [
        p
        for shape in usable
        if (p := prepare(costs, shape, probe, memory_limit, space.recompute, parts)) is not None
    ]
    fitting, over = rank(prepared, probe, memory_limit)
    return SearchResult(
        tuple(fitting),
        tuple(over),
        tuple(refused),
        tuple(prepared),
        memory_limit,
        time.perf_counter() - start,
    )
