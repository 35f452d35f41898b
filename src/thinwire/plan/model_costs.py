"""What the planner knows of a model: each part profiled once per tensor-parallel degree and
micro-batch size, each part's data-parallel exchange measured once per (``tp``, ``dp``,
method), and any stage's cost composed from them.

:func:`profile_model` measures, for each ``tp``, in one fresh process on PyTorch's fake
process group (:mod:`thinwire.plan.stage_profile`): the embedding, each distinct kind of
block and the head with its loss, at every micro-batch size the search will need (compute,
tensor-parallel all-reduces, saved activations, optimizer step and state), then every
part's exchange through thinwire's engine (:func:`thinwire.plan.profile_method.
measure_method`) for each data-parallel degree and method. Results are cached per ``tp``
(a profile is the slow part; the search is pure arithmetic on it).
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from thinwire.plan.block_profiles import BlockProfiles, compose_stage, in_subbatches_of
from thinwire.plan.cost import MethodCost
from thinwire.plan.hybrid_cost import StageCost
from thinwire.plan.model_source import ModelSource
from thinwire.plan.stage_buckets import rebucketed

#: a bucket size no part reaches: each part's exchange is measured as one bucket
ONE_BUCKET_MB = 1e6

#: what a data-parallel method is in a search: its name and options
Method = tuple[str, Mapping[str, Any]]


def method_label(method: Method) -> str:
    """``name`` or ``name(key=value,...)``, as plans are written on the command line."""
    name, options = method
    if not options:
        return name
    return f"{name}(" + ",".join(f"{k}={v}" for k, v in sorted(options.items())) + ")"


@dataclass(frozen=True)
class PartExchange:
    """One part's data-parallel exchange: its cost per step and the state it keeps."""

    cost: MethodCost
    state_bytes: int
    optimizer_s: float | None = None
    """The optimizer step over the part once the exchange has written its gradients
    (:mod:`thinwire.plan.optimizer_profile`; ``None``: a method whose averaging is not
    a gradient exchange, DiLoCo's, and the compute profile's dense-gradient step)."""


@dataclass
class ModelCosts:
    """Profiles of a model's parts, keyed by what they depend on.

    ``compute[(tp, microbatch_size)]``: every part under a ``tp``-way shard on one
    micro-batch. ``exchange[(tp, dp, method label)]``: every part's exchange (first,
    each block, last, in :class:`BlockProfiles` order). ``refused[tp]``: why the model
    cannot run ``tp``-way tensor parallel."""

    source: ModelSource
    blocks: int
    batch_size: int
    parameters: int
    compute: dict[tuple[int, int], BlockProfiles] = field(default_factory=dict)
    exchange: dict[tuple[int, int, str], tuple[PartExchange, ...]] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)

    def __getstate__(self) -> dict:
        """What a pickle keeps: the profiles, not the parts worked out from them."""
        return {k: v for k, v in self.__dict__.items() if k != "_in_subbatches"}

    def _parts(self, tp: int, microbatch: int, subbatches: int) -> BlockProfiles:
        """The parts at a sub-batch's size, worked out once per (tp, micro-batch,
        sub-batches): the search asks for them for every stage of every plan."""
        cache = self.__dict__.setdefault("_in_subbatches", {})
        key = (tp, microbatch, subbatches)
        if key not in cache:
            cache[key] = in_subbatches_of(self.compute[(tp, microbatch // subbatches)], subbatches)
        return cache[key]

    def merge(self, other: ModelCosts) -> None:
        """Add ``other``'s profiles (another ``tp``) to these."""
        self.__dict__.pop("_in_subbatches", None)
        self.compute.update(other.compute)
        self.exchange.update(other.exchange)
        self.refused.update(other.refused)

    def stage(
        self, tp: int, microbatch: int, dp: int, method: Method, blocks: range, *,
        first: bool, last: bool, recompute: float = 0.0, subbatches: int = 1,
    ) -> StageCost:  # fmt: skip
        """One rank's cost of a stage holding ``blocks`` (and the embedding if ``first``,
        the head and loss if ``last``) under ``tp`` and ``dp`` with ``method``,
        recomputing ``recompute`` of its blocks, each micro-batch in ``subbatches``
        sub-batches (its parts profiled at the sub-batch's size)."""
        parts = self._parts(tp, microbatch, subbatches)
        cost = compose_stage(parts, blocks, first=first, last=last, recompute=recompute)
        if dp == 1:
            return cost
        exchanges = self.exchange[(tp, dp, method_label(method))]
        chosen = [*([exchanges[0]] if first else []), *(exchanges[1 + i] for i in blocks)]
        chosen += [exchanges[-1]] if last else []
        stepped = [e.optimizer_s for e in chosen]
        optimizer_s = cost.optimizer_s  # the compute profile's, on dense gradients
        if None not in stepped:
            optimizer_s = sum(s for s in stepped if s is not None)
        return replace(
            cost,
            dp_cost=rebucketed([e.cost for e in chosen]),
            exchange_bytes=sum(e.state_bytes for e in chosen),
            optimizer_s=optimizer_s,
        )


def _part_shapes(parts: BlockProfiles) -> list[tuple[tuple[int, ...], ...]]:
    inner = [b.parameter_shapes for b in parts.blocks]
    return [parts.first.parameter_shapes, *inner, parts.last.parameter_shapes]


def measure_exchanges(
    parts: BlockProfiles, dp: int, method: Method, repeats: int, optimizer: str = "adamw",
    optimizer_repeats: int = 3,
) -> tuple[PartExchange, ...]:  # fmt: skip
    """Each part's exchange under ``dp``-way data parallelism with ``method`` (first, each
    block, last), measured through what the trainer runs for it, one bucket a part, and
    ``optimizer``'s step on the gradients that exchange writes."""
    from thinwire.data_parallel.local_methods import ROUND_METHODS
    from thinwire.parallel.plan import engine_compressor
    from thinwire.plan.memory import exchange_state_bytes
    from thinwire.plan.optimizer_profile import exchanged_gradients, optimizer_step_s
    from thinwire.plan.profile_method import measure_method

    name, options = method
    name = engine_compressor(name)  # what the trainer's engine runs, copies included
    measured: dict[tuple, PartExchange] = {}
    result = []
    for shapes in _part_shapes(parts):
        if shapes not in measured:
            params = [(f"p{i}", torch.randn(shape)) for i, shape in enumerate(shapes)]
            cost = measure_method(  # one bucket per part: rebucketed() makes the stage's
                name, params, world_size=dp, options=dict(options), repeats=repeats,
                bucket_cap_mb=ONE_BUCKET_MB,
            )  # fmt: skip
            state = exchange_state_bytes(name, params, world_size=dp, options=dict(options))
            stepped = None if name in ROUND_METHODS else 0.0  # no parameters: no step
            if stepped is not None and shapes:
                given = exchanged_gradients(name, dict(options), shapes, dp)
                stepped, _ = optimizer_step_s(optimizer, shapes, optimizer_repeats, given)
            measured[shapes] = PartExchange(cost, state, stepped)
        result.append(measured[shapes])
    return tuple(result)


def _profile_tp(
    source: ModelSource, tp: int, sizes: Sequence[int], exchanges: Sequence[tuple[int, Method]],
    repeats: int, optimizer: str,
) -> ModelCosts:  # fmt: skip
    """In a fresh process: the parts under ``tp`` at each micro-batch size, and their
    exchanges for each ``(dp, method)``."""
    from thinwire.parallel.layout import read_layout, submodule
    from thinwire.parallel.plan import ParallelPlan
    from thinwire.parallel.tensor import check_tensor_parallel
    from thinwire.plan.block_profiles import block_profiles
    from thinwire.plan.stage_profile import fake_world

    model, _ = source.build()
    layout = read_layout(model)
    costs = ModelCosts(
        replace(source, live=None),  # the pickled model stays out of the profile
        blocks=len(submodule(model, layout.blocks)),
        batch_size=source.batch(),
        parameters=sum(p.numel() for p in model.parameters()),
    )
    del model
    try:
        check_tensor_parallel(layout, tp)
    except ValueError as error:
        costs.refused[tp] = str(error)
        return costs
    plan = ParallelPlan(tp=tp)
    with fake_world(source, plan, max(sizes)) as world:
        tokens, targets = world.batch
        for size in sorted(sizes):
            sized = replace(world, batch=(tokens[:size], targets[:size]))
            costs.compute[(tp, size)] = block_profiles(sized, plan, repeats, optimizer)
    parts = costs.compute[(tp, max(sizes))]
    for dp, method in exchanges:
        costs.exchange[(tp, dp, method_label(method))] = measure_exchanges(
            parts, dp, method, 1, optimizer
        )
    return costs


def profile_model(
    source: ModelSource,
    needs: Mapping[int, tuple[Iterable[int], Iterable[tuple[int, Method]]]],
    *,
    repeats: int = 3,
    optimizer: str = "adamw",
    cache: Path | None = None,
    log: Any = None,
) -> ModelCosts:
    """The profiles a search needs: ``needs[tp] = (micro-batch sizes, [(dp, method)])``.
    Each ``tp`` runs in a fresh process (a core to itself), or comes from ``cache``."""
    from thinwire.plan.stage_profile import in_fresh_process

    merged: ModelCosts | None = None
    keys: dict[int, str] = {}
    missing: list[tuple[int, list[int], list[tuple[int, Method]]]] = []
    missing_costs: dict[int, ModelCosts] = {}
    for tp in sorted(needs):
        sizes = sorted(set(needs[tp][0]))
        exchanges = sorted({(dp, method_label(m)): (dp, m) for dp, m in needs[tp][1]}.items())
        wanted = [pair for _, pair in exchanges]
        live = hashlib.sha256(source.live).hexdigest() if source.live else None
        keys[tp] = json.dumps(
            [source.name, dict(source.options), source.batch_size, source.seq_len, live, tp, sizes,
             [(dp, method_label(m)) for dp, m in wanted], repeats, optimizer, _FORMAT],
            sort_keys=True, default=str,
        )  # fmt: skip
        if _cached(cache, keys[tp]) is None:
            missing.append((tp, sizes, wanted))
            if log is not None:
                log(f"profiling tp={tp}: micro-batches of {sizes}, {len(wanted)} exchanges")
    if missing:  # one fresh process for all of them (a core to itself)
        for (tp, _, _), costs in zip(
            missing,
            in_fresh_process(_profile_many, source, missing, repeats, optimizer),
            strict=True,
        ):
            _store(cache, keys[tp], costs)
            missing_costs[tp] = costs
    for tp in sorted(needs):
        costs = missing_costs.get(tp) or _cached(cache, keys[tp])
        assert costs is not None
        if merged is None:
            merged = costs
        else:
            merged.merge(costs)
    if merged is None:
        raise ValueError("nothing to profile: no tensor-parallel degree was asked for")
    return merged


def _profile_many(
    source: ModelSource, wanted: Sequence[tuple[int, Sequence[int], Sequence[tuple[int, Method]]]],
    repeats: int, optimizer: str,
) -> list[ModelCosts]:  # fmt: skip
    """:func:`_profile_tp` for each ``(tp, sizes, exchanges)``, one after another."""
    return [_profile_tp(source, tp, sizes, ex, repeats, optimizer) for tp, sizes, ex in wanted]


#: bump when what a profile holds changes (older caches are profiled again)
_FORMAT = 5


def _cached(cache: Path | None, key: str) -> ModelCosts | None:
    if cache is None:
        return None
    path = cache / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.pkl"
    if not path.exists():
        return None
    try:
        stored_key, costs = pickle.loads(path.read_bytes())
    except (pickle.UnpicklingError, ImportError, AttributeError, EOFError, ValueError):
        return None  # written by another version of thinwire
    return costs if stored_key == key else None


def _store(cache: Path | None, key: str, costs: ModelCosts) -> None:
    if cache is None:
        return
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.pkl"
    partial = path.with_suffix(".part")
    partial.write_bytes(pickle.dumps((key, costs)))
    partial.replace(path)
