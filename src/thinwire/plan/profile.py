"""Measure what the cost model needs, in this process, on one thread.

- :func:`measure_compute`: forward, backward and optimizer time of a model on a batch
  (median of a few runs after warm-up), and when each parameter's gradient is ready
  during the backward pass (which decides how much communication can overlap it).
- :func:`ddp_buckets`: DDP's gradient buckets (after its first-iteration rebuild: in the
  order gradients become ready, the first one capped at 1 MiB, the others at 25 MiB, or
  one limit per bucket); :func:`bucket_groups` for a ``bucket_cap_mb`` as the bench takes
  it (a size, or ``"tapered"``).
- :func:`measure_method`: per bucket, the collectives a method issues (kind and bytes)
  and the CPU time of its compression and decompression, on random gradients of the
  model's real shapes; for the embedding methods, also the tables' traffic, from the ids
  the task's batches look up (:mod:`thinwire.plan.embedding`). thinwire's methods run
  through thinwire's own exchange engine (memory, protocols, rounds fused across
  buckets); PyTorch's hooks through a copy of their tensor math. Gathered payloads are
  decoded ``world_size`` times, as every rank decodes every rank's payload.

No ``torch.distributed`` process group is needed: collectives are answered locally (a sum
is ``world_size`` copies of this rank's payload, a gather ``world_size`` payloads).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from thinwire.comm.buckets import (
    DDP_DEFAULT_LIMITS_MB,
    MB,
    BucketSpec,
    assign_buckets,
    bucket_limits_mb,
)
from thinwire.comm.collectives import Communicator, RoundResult, group_by_op_and_dtype
from thinwire.comm.engine import GradientExchange, GradientItem
from thinwire.compress.base import Aggregation, Compressor, Op, Request
from thinwire.plan.cost import (
    ALLGATHER,
    ALLREDUCE,
    BucketCost,
    Collective,
    ComputeTime,
    Link,
    MethodCost,
    StepPrediction,
    predict_step,
)
from thinwire.plan.embedding import TableLookups, measure_lookups, table_traffic
from thinwire.plan.methods import (
    EMBEDDING_KINDS,
    WRAPPER_KINDS,
    Kind,
    method_kind,
    method_options,
    split_communicator,
)

#: DDP's defaults (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` and ``bucket_cap_mb``)
FIRST_BUCKET_MB, BUCKET_CAP_MB = DDP_DEFAULT_LIMITS_MB
#: how many steps of every rank's batches the embedding lookups are measured on
LOOKUP_STEPS = 4

NamedTensors = Sequence[tuple[str, Tensor]]


@dataclass(frozen=True)
class ComputeProfile:
    """One worker's compute: the phase times, and for each parameter the fraction of the
    backward pass after which its gradient is ready (``ready``), in ready ``order``."""

    time: ComputeTime
    ready: Mapping[str, float]
    order: tuple[str, ...]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with one intra-op thread (as every benchmark worker does)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_compute(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    repeats: int = 5,
    warmup: int = 2,
) -> ComputeProfile:
    """Time forward, backward and optimizer step of ``model`` on ``batch`` (medians of
    ``repeats`` runs after ``warmup``), on one thread. The model is trained by the runs
    (default optimizer: SGD, lr 0.01, momentum 0.9)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no parameters that require gradients")
    opt = optimizer or torch.optim.SGD([p for _, p in named], lr=0.01, momentum=0.9)
    stamps: dict[str, float] = {}

    def stamper(name: str) -> Callable[[Tensor], None]:
        def stamp(_: Tensor) -> None:
            stamps.setdefault(name, time.perf_counter())

        return stamp

    handles = [p.register_post_accumulate_grad_hook(stamper(name)) for name, p in named]
    x, y = batch
    phases: list[tuple[float, float, float]] = []
    ready: dict[str, list[float]] = {name: [] for name, _ in named}
    orders: list[tuple[str, ...]] = []
    model.train()
    try:
        with one_thread():
            for run in range(warmup + repeats):
                opt.zero_grad(set_to_none=True)
                stamps.clear()
                t0 = time.perf_counter()
                loss = loss_fn(model(x), y)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                opt.step()
                t3 = time.perf_counter()
                if run < warmup:
                    continue
                phases.append((t1 - t0, t2 - t1, t3 - t2))
                for name, _ in named:  # unused parameters: ready at the end
                    ready[name].append(min(1.0, (stamps.get(name, t2) - t1) / (t2 - t1)))
                orders.append(tuple(sorted(stamps, key=stamps.__getitem__)))
    finally:
        for handle in handles:
            handle.remove()
        opt.zero_grad(set_to_none=True)
    forward, backward, step = (statistics.median(p[i] for p in phases) for i in range(3))
    order = orders[-1] + tuple(n for n, _ in reversed(named) if n not in orders[-1])
    return ComputeProfile(
        ComputeTime(forward, backward, step),
        {name: statistics.median(values) for name, values in ready.items()},
        order,
    )


def ddp_buckets(
    params: NamedTensors,
    order: Sequence[str] | None = None,
    *,
    bucket_cap_mb: float = BUCKET_CAP_MB,
    first_bucket_mb: float = FIRST_BUCKET_MB,
    limits_mb: Sequence[float] | None = None,
) -> list[list[str]]:
    """DDP's buckets of ``params`` (names), in the order DDP reduces them.

    Parameters are taken in gradient-ready ``order`` (default: reverse definition order,
    what the backward pass usually produces); a bucket closes once it holds at least its
    limit: ``first_bucket_mb`` for the first, ``bucket_cap_mb`` for the others (DDP's
    rebuilt buckets after the first iteration, for one dtype and device), or
    ``limits_mb[i]`` for bucket ``i``, the last repeated (DDP's ``bucket_cap_mb_list``).
    """
    if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
        raise ValueError(
            f"bucket sizes must be > 0 MB, got bucket_cap_mb={bucket_cap_mb}, "
            f"first_bucket_mb={first_bucket_mb}"
        )
    sizes = {name: t.numel() * t.element_size() for name, t in params}
    names = _ready_names(params, order)
    limits = [first_bucket_mb, bucket_cap_mb] if limits_mb is None else list(limits_mb)
    groups = assign_buckets([sizes[n] for n in names], [int(limit * MB) for limit in limits])
    return [[names[i] for i in group] for group in groups]


def _ready_names(params: NamedTensors, order: Sequence[str] | None) -> list[str]:
    """``params``' names in ready ``order`` (default: reverse definition order), checked."""
    known = {name for name, _ in params}
    names = list(order) if order is not None else [n for n, _ in reversed(params)]
    missing = known - set(names)
    if missing or len(names) != len(known) or set(names) != known:
        raise ValueError(
            f"order must name each of the {len(known)} parameters once; "
            f"missing {sorted(missing)[:5]}, got {len(names)} names"
        )
    return names


def bucket_groups(
    params: NamedTensors, order: Sequence[str] | None, spec: BucketSpec
) -> list[list[str]]:
    """DDP's buckets (names, reduction order) under ``bucket_cap_mb`` = ``spec``: DDP's
    default (``None`` or :data:`BUCKET_CAP_MB`: a 1 MB first bucket, then 25 MB), one
    size given explicitly (the first bucket's too, as DDP does), or a taper
    (``"tapered"``, ``"tapered:TAIL:FACTOR"``: :func:`thinwire.tapered_buckets`)."""
    if spec == BUCKET_CAP_MB:
        spec = None
    sizes = {name: t.numel() * t.element_size() for name, t in params}
    names = _ready_names(params, order)
    limits = bucket_limits_mb(spec, [sizes[n] for n in names])
    return ddp_buckets(params, names, limits_mb=limits)


def measure_method(
    method: str,
    params: NamedTensors,
    *,
    world_size: int,
    options: Mapping[str, Any] | None = None,
    compute: ComputeProfile | None = None,
    bucket_cap_mb: BucketSpec = BUCKET_CAP_MB,
    repeats: int = 3,
    seed: int = 0,
    fuse_rounds: bool = True,
    broadcast_bytes: int = 0,
    lookups: Sequence[TableLookups] | None = None,
) -> MethodCost:
    """What ``method`` sends per step for parameters ``params`` and how long its
    compression takes (median of ``repeats`` steps after one warm-up step, past any density
    warm-up), bucketed as DDP does (ready order and fractions from ``compute``).
    ``fuse_rounds``: a thinwire compressor's later rounds travel with the next bucket's
    first, as :func:`thinwire.register` does by default. ``broadcast_bytes``: the buffers
    DDP broadcasts before every forward pass, for the methods that run under DDP.
    ``lookups``: the embedding tables' measured lookups, which the embedding methods need
    (:func:`thinwire.plan.embedding.measure_lookups`)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size (workers) must be an integer >= 1, got {world_size!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    kind = method_kind(method)
    opts = method_options(method, options)
    params = [(n, p) for n, p in params]
    if kind in EMBEDDING_KINDS:
        if lookups is None:
            raise ValueError(
                f"{method!r} sends what each batch looks up: profile it with its task "
                "(profile_task, thinwire plan --task), or pass lookups= "
                "(thinwire.plan.embedding.measure_lookups) so that the ids are known"
            )
        return _embedding_cost(
            method,
            opts,
            params,
            lookups,
            world_size=world_size,
            compute=compute,
            bucket_cap_mb=bucket_cap_mb,
            repeats=repeats,
            seed=seed,
            fuse_rounds=fuse_rounds,
            broadcast_bytes=broadcast_bytes,
        )
    dense_bytes = sum(p.numel() * 4 for _, p in params)
    if kind is Kind.LOCAL:
        return MethodCost(method, (), dense_bytes, opts)
    order = compute.order if compute is not None else None
    if kind in WRAPPER_KINDS:
        return _wrapper_cost(method, kind, opts, params, world_size, repeats, seed)
    if kind is Kind.DDP_POWERSGD:
        # thinwire bench runs PyTorch's PowerSGD hook with one bucket on gloo (its
        # callback-issued all-reduces race between buckets there): model it that way
        groups = [[n for n, _ in reversed(params)] if order is None else list(order)]
    else:
        groups = bucket_groups(params, order, bucket_cap_mb)
    exchanger = _exchanger(kind, method, opts, world_size, fuse_rounds)
    ready_of = (lambda names: max(compute.ready[n] for n in names)) if compute else None
    buckets = _measure_buckets(
        params, groups, exchanger, repeats, seed, ready_of, timed=kind is not Kind.DDP
    )
    return MethodCost(method, tuple(buckets), dense_bytes, opts, broadcast_bytes=broadcast_bytes)


def _embedding_cost(
    method: str,
    opts: Mapping[str, Any],
    params: NamedTensors,
    lookups: Sequence[TableLookups],
    *,
    world_size: int,
    compute: ComputeProfile | None,
    **measure: Any,
) -> MethodCost:
    """An embedding method: the tables' traffic (measured lookups) and the rest of the
    model through DDP, or through the method's ``compressor`` under DDP."""
    tables = {table.name for table in lookups}
    unknown = tables - {name for name, _ in params}
    if unknown:
        raise ValueError(
            f"lookups name tables that are not trainable parameters: {sorted(unknown)} (a "
            "frozen table needs no exchange: leave it out of the lookups, or unfreeze it)"
        )
    head = [(n, p) for n, p in params if n not in tables]
    head_compute = None
    if compute is not None:
        head_compute = ComputeProfile(
            compute.time,
            {n: compute.ready[n] for n, _ in head},
            tuple(n for n in compute.order if n not in tables),
        )
    compressor = str(opts.get("compressor", "none"))
    head_cost = measure_method(
        "dense" if compressor == "none" else compressor,
        head,
        world_size=world_size,
        options=None if compressor == "none" else opts.get("compressor_options"),
        compute=head_compute,
        **measure,
    )
    traffic = table_traffic(method, lookups, dict(opts), world_size)
    ready = max((compute.ready[name] for name in tables), default=1.0) if compute else 1.0
    rows = BucketCost(ready, 0.0, traffic.backward, numel=sum(t.rows * t.dim for t in lookups))
    return MethodCost(
        method,
        (*head_cost.buckets, rows),
        sum(p.numel() * 4 for _, p in params),
        opts,
        broadcast_bytes=head_cost.broadcast_bytes,
        forward_collectives=traffic.forward,
        background_collectives=traffic.background,
    )


def _wrapper_cost(
    method: str,
    kind: Kind,
    options: Mapping[str, Any],
    params: list[tuple[str, Tensor]],
    world_size: int,
    repeats: int,
    seed: int,
) -> MethodCost:
    """``dga`` and the parameter server: their compressor's traffic in the optimizer
    wrapper's buckets (25 MB, ready when the backward pass ends), scheduled their way."""
    from thinwire.compress.registry import compressor as build

    names = [n for n, _ in reversed(params)]
    groups = ddp_buckets(params, names, bucket_cap_mb=BUCKET_CAP_MB, first_bucket_mb=BUCKET_CAP_MB)
    exchanger = _ThinwireEngine(
        build(options["compressor"], **options["compressor_options"]),
        world_size,
        fuse_rounds=False,  # DGA and the parameter server exchange each bucket alone
    )
    timed = options["compressor"] != "none"
    buckets = _measure_buckets(params, groups, exchanger, repeats, seed, None, timed=timed)
    dense_bytes = sum(p.numel() * 4 for _, p in params)
    return MethodCost(method, tuple(buckets), dense_bytes, options, schedule=kind.value)


def _measure_buckets(
    params: list[tuple[str, Tensor]],
    groups: list[list[str]],
    exchanger: Exchanger,
    repeats: int,
    seed: int,
    ready_of: Callable[[list[str]], float] | None,
    *,
    timed: bool,
) -> list[BucketCost]:
    """Run ``exchanger`` on the buckets of ``groups``, in order, for one warm-up step and
    ``repeats`` timed steps on fresh random gradients: each bucket's collectives and, if
    ``timed``, its median compression time; ``ready_of(names)`` is when the bucket is ready
    (default: 1.0). The collectives are those of the timed step that sent the most: a
    compressor whose traffic alternates between steps (``powersgd-oneround`` with
    ``alternate``) is modelled at its heavier step whatever ``repeats`` is."""
    by_name = dict(params)
    generator = torch.Generator().manual_seed(seed)
    buckets = [
        _Bucket(index, [(n, by_name[n]) for n in names]) for index, names in enumerate(groups)
    ]
    times: list[list[float]] = [[] for _ in buckets]
    steps: list[list[list[Collective]]] = []
    with one_thread():
        for run in range(repeats + 1):
            step: list[list[Collective]] = []
            for bucket in buckets:
                bucket.fill(generator)
                started = time.perf_counter()
                step.append(exchanger(bucket, run, bucket is buckets[-1]))
                if run:
                    times[bucket.index].append(time.perf_counter() - started)
            if run:
                steps.append(step)
    collectives = max(steps, key=lambda step: sum(c.nbytes for b in step for c in b))
    return [
        BucketCost(
            ready_of(names) if ready_of is not None and names else 1.0,
            statistics.median(times[bucket.index]) if timed else 0.0,
            tuple(collectives[bucket.index]),
            bucket.numel,
        )
        for bucket, names in zip(buckets, groups, strict=True)
    ]


# -- the bucket a hook sees -----------------------------------------------------------------


class _Bucket:
    """A DDP-style bucket: one flat fp32 buffer, a view per parameter."""

    def __init__(self, index: int, params: Sequence[tuple[str, Tensor]]) -> None:
        self.index = index
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.numel = sum(p.numel() for p in self.params)
        self.buffer = torch.empty(self.numel, dtype=torch.float32)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()

    def fill(self, generator: torch.Generator) -> None:
        """Fresh random gradients (small, like real ones)."""
        self.buffer.copy_(torch.randn(self.numel, generator=generator)).mul_(1e-3)

    def store(self, means: Sequence[Tensor]) -> None:
        """Write the averaged gradients into the bucket, as a DDP hook's future does."""
        for view, mean in zip(self.views, means, strict=True):
            view.copy_(mean)


#: exchanges one bucket: ``(bucket, run, last)`` -> the collectives it issued (``run``: the
#: step's index; ``last``: the step's last bucket); the averaged gradients land in the bucket
Exchanger = Callable[[_Bucket, int, bool], list[Collective]]


def _exchanger(
    kind: Kind, method: str, options: Mapping[str, Any], world: int, fuse_rounds: bool
) -> Exchanger:
    if kind is Kind.DDP:
        return lambda bucket, run, last: [Collective(ALLREDUCE, bucket.numel * 4)]
    if kind is Kind.DDP_FP16:
        return lambda bucket, run, last: _fp16_hook(bucket, world)
    if kind is Kind.DDP_POWERSGD:
        return _TorchPowerSGD(options, world)
    from thinwire.compress.registry import compressor as build

    options_of_compressor, communicator = split_communicator(options)
    return _ThinwireEngine(build(method, **options_of_compressor), world, fuse_rounds, communicator)


def _fp16_hook(bucket: _Bucket, world: int) -> list[Collective]:
    """What ``fp16_compress_hook`` does around its all-reduce."""
    half = bucket.buffer.to(torch.float16).div_(world)
    bucket.buffer.copy_(half)
    return [Collective(ALLREDUCE, half.numel() * half.element_size())]


class _LocalCommunicator(Communicator):
    """A communicator without peers: answers each round as if every rank had sent this
    rank's payload, and records the collectives the real one (``kind``: all-reduce,
    all-gather or direct) would issue: one all-gather or all-to-all of every request plus a
    status byte, or one all-reduce per (op, dtype)."""

    checks_start = False  # no peers to agree with

    def __init__(self, world: int, kind: str) -> None:  # no process group needed
        self.group, self.world_size, self.rank, self.timeout = None, world, 0, None
        self.kind = kind
        self.name = kind
        #: what the rounds since it was last emptied would have sent
        self.sent: list[Collective] = []

    def supports(self, op: Op) -> bool:
        """Everything when gathering; sums and maxima under all-reduce."""
        return self.kind != ALLREDUCE or op in (Op.SUM, Op.MAX)

    def _execute(self, requests: Sequence[Request], poison: bool) -> RoundResult:
        if self.kind != ALLREDUCE:
            payload = sum(_nbytes(t) for r in requests for t in r.tensors)
            self.sent.append(Collective(self.kind, payload + 1))
        else:
            for (_, dtype), members in group_by_op_and_dtype(requests).items():
                numel = sum(t.numel() for i in members for t in requests[i].tensors)
                self.sent.append(Collective(ALLREDUCE, numel * dtype.itemsize))
        return RoundResult([_answer(r, self.world_size) for r in requests], poisoned=False)


class _ThinwireEngine:
    """thinwire's own exchange engine on a :class:`_LocalCommunicator`: the real memory,
    protocols and schedule (rounds fused across buckets as the DDP hook and
    ``DistributedOptimizer`` do, or each bucket's alone as DGA and the parameter server
    do), with collectives recorded, not sent."""

    def __init__(
        self, compressor: Compressor, world: int, fuse_rounds: bool, communicator: str = "auto"
    ) -> None:
        if communicator == "auto":
            summable = compressor.aggregation is Aggregation.SUM
            communicator = ALLREDUCE if summable else ALLGATHER
        self.communicator = _LocalCommunicator(world, communicator)
        self.engine = GradientExchange(compressor, communicator=self.communicator, history=1)
        self.engine.step = int(getattr(compressor, "warmup_steps", 0) or 0)  # past warm-up
        self.fuse_rounds = fuse_rounds

    def __call__(self, bucket: _Bucket, run: int, last: bool) -> list[Collective]:
        items = [
            GradientItem(name, view, param)
            for name, view, param in zip(bucket.names, bucket.views, bucket.params, strict=True)
        ]
        self.communicator.sent = []
        if self.fuse_rounds:
            for done, means in self.engine.exchange_fused(items, bucket, last):
                done.store(means)
        else:
            bucket.store(self.engine.exchange(items))
        if last:
            self.engine.end_step()
        return self.communicator.sent


def _answer(request: Request, world: int) -> Any:
    """What the collective would return if every rank had sent this rank's payload."""
    if request.op is Op.GATHER:
        return [list(request.tensors)] * world
    if request.op is Op.SUM:
        return [t * world for t in request.tensors]
    return [t.clone() for t in request.tensors]


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _TorchPowerSGD:
    """The tensor math of PyTorch's ``powerSGD_hook`` past ``start_powerSGD_iter`` (error
    feedback, warm start), with its three chained all-reduces per bucket: the uncompressed
    tensors, the P factors, the Q factors (empty ones are not counted)."""

    def __init__(self, options: Mapping[str, Any], world: int) -> None:
        self.rank = int(options["matrix_approximation_rank"])
        self.min_rate = float(options.get("min_compression_rate", 2))
        self.error_feedback = bool(options.get("use_error_feedback", True))
        self.warm_start = bool(options.get("warm_start", True))
        self.epsilon = float(options.get("orthogonalization_epsilon", 0))
        self.world = world
        self.errors: dict[int, Tensor] = {}
        self.qs: dict[int, Tensor] = {}

    def __call__(self, bucket: _Bucket, run: int, last: bool) -> list[Collective]:
        buffer = bucket.buffer
        copy = None
        if self.error_feedback:
            if bucket.index in self.errors:
                buffer.add_(self.errors[bucket.index])
            copy = buffer.clone()
        matrices, plain = [], []
        for view in bucket.views:
            n = view.shape[0] if view.dim() else 1
            m = view.numel() // max(n, 1)
            r = min(n, m, self.rank)
            if (n + m) * r * self.min_rate < n * m:
                matrices.append((view.reshape(1, n, m), r))
            else:
                plain.append(view)
        flat_plain = torch.cat([t.reshape(-1) for t in plain]) if plain else buffer[:0]
        p_size = sum(mat.shape[1] * r for mat, r in matrices)
        q_size = sum(mat.shape[2] * r for mat, r in matrices)
        q_memory = self.qs.get(bucket.index)
        if q_memory is None or not self.warm_start:
            q_memory = torch.randn(q_size)
        p_memory = torch.empty(p_size)
        ps, qs, p_at, q_at = [], [], 0, 0
        for mat, r in matrices:
            _, n, m = mat.shape
            ps.append(p_memory[p_at : p_at + n * r].view(1, n, r))
            qs.append(q_memory[q_at : q_at + m * r].view(1, m, r))
            p_at, q_at = p_at + n * r, q_at + m * r
        for q in qs:
            _orthogonalize(q, self.epsilon)
        for (mat, _), q, p in zip(matrices, qs, ps, strict=True):
            torch.bmm(mat, q, out=p)
        flat_plain.mul_(self.world).div_(self.world)  # the summed uncompressed tensors
        offset = 0
        for t in plain:
            t.copy_(flat_plain[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        p_memory.mul_(self.world)  # the summed P
        for p in ps:
            _orthogonalize(p, self.epsilon)
        for (mat, _), p, q in zip(matrices, ps, qs, strict=True):
            torch.bmm(mat.transpose(1, 2), p, out=q)
        q_memory.mul_(self.world).div_(self.world)  # the summed Q, averaged
        for (mat, _), p, q in zip(matrices, ps, qs, strict=True):
            torch.bmm(p, q.transpose(1, 2), out=mat)
        if copy is not None:
            self.errors[bucket.index] = copy - buffer
        self.qs[bucket.index] = q_memory
        sizes = (flat_plain.numel() * 4, p_size * 4, q_size * 4)
        return [Collective(ALLREDUCE, nbytes) for nbytes in sizes if nbytes]


def _orthogonalize(matrices: Tensor, epsilon: float) -> None:
    """PyTorch's own orthogonalisation (Gram-Schmidt for rank <= 2, QR above)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    powerSGD_hook._orthogonalize(matrices, epsilon)


# -- a whole model --------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """A model's compute profile and every requested method's traffic, for one world size."""

    compute: ComputeProfile
    costs: dict[str, MethodCost]
    world_size: int

    def predict(
        self,
        method: str,
        link: Link,
        *,
        compute: ComputeTime | float | None = None,
        overlap: bool = True,
    ) -> StepPrediction:
        """Predict ``method``'s step on ``link`` for :attr:`world_size` workers.

        ``compute``: one worker's compute measured on the real cluster, as phases
        (:class:`ComputeTime`) or as the compute-only step time in seconds (the ``local``
        run's median step; the profiled phases are scaled to it). It replaces the profiled
        compute and scales the profiled compression times by the same factor (workers that
        share CPUs are slower at both). Default: this process's profile as it is.
        """
        if method not in self.costs:
            raise ValueError(f"method {method!r} was not profiled; profiled: {list(self.costs)}")
        cost = self.costs[method]
        profiled = self.compute.time
        if isinstance(compute, (int, float)):
            if not (compute > 0 and math.isfinite(compute)):
                raise ValueError(f"compute step time must be > 0 s, got {compute!r}")
            compute = profiled.scaled(compute / profiled.total)
        if compute is not None:
            if profiled.total > 0 and compute.total > 0:
                cost = cost.scaled(compute.total / profiled.total)
            profiled = compute
        return predict_step(profiled, cost, link, self.world_size, overlap=overlap)


def profile_model(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    methods: Mapping[str, Mapping[str, Any] | None],
    *,
    world_size: int,
    repeats: int = 5,
    method_repeats: int = 3,
    bucket_cap_mb: BucketSpec = BUCKET_CAP_MB,
    fuse_rounds: bool = True,
    broadcast_buffers: bool = True,
    lookups: Sequence[TableLookups] | None = None,
) -> Profile:
    """Measure ``model``'s compute on ``batch`` and each method's traffic and compression
    time (``methods``: name -> options) for ``world_size`` workers (``fuse_rounds``: see
    :func:`measure_method`; ``broadcast_buffers``: DDP's option of that name, whose
    broadcast of the model's buffers before each forward pass the DDP methods pay;
    ``lookups``: the embedding tables' lookups, for the embedding methods)."""
    for name, opts in methods.items():
        method_options(name, opts)  # fail fast, before the slow part
        if method_kind(name) in EMBEDDING_KINDS and lookups is None:
            raise ValueError(
                f"{name!r} needs the tables' lookups: pass lookups= "
                "(thinwire.plan.embedding.measure_lookups), or use profile_task"
            )
    compute = measure_compute(model, batch, loss_fn, repeats=repeats)
    params = [(n, p.detach()) for n, p in model.named_parameters() if p.requires_grad]
    buffer_bytes = (
        sum(b.numel() * b.element_size() for b in model.buffers()) if broadcast_buffers else 0
    )
    costs = {
        name: measure_method(
            name,
            params,
            world_size=world_size,
            options=opts,
            compute=compute,
            bucket_cap_mb=bucket_cap_mb,
            repeats=method_repeats,
            fuse_rounds=fuse_rounds,
            broadcast_bytes=buffer_bytes,
            lookups=lookups,
        )
        for name, opts in methods.items()
    }
    return Profile(compute, costs, world_size)


def profile_task(
    task: Any,
    methods: Mapping[str, Mapping[str, Any] | None],
    *,
    world_size: int,
    repeats: int = 5,
    method_repeats: int = 3,
    **options: Any,
) -> Profile:
    """:func:`profile_model` for a :class:`thinwire.tasks.Task` (rank 0's first batch);
    ``options`` go to :func:`profile_model` (``bucket_cap_mb``, ``broadcast_buffers``).
    For the embedding methods, every rank's lookups are measured on its first batches."""
    model = task.build_model()
    batch = task.batch(0, world_size, 0)
    if any(method_kind(name) in EMBEDDING_KINDS for name in methods):
        options.setdefault("lookups", task_lookups(task, model, world_size))
    return profile_model(
        model,
        batch,
        task.loss,
        methods,
        world_size=world_size,
        repeats=repeats,
        method_repeats=method_repeats,
        **options,
    )


def task_lookups(
    task: Any, model: nn.Module, world_size: int, steps: int = LOOKUP_STEPS
) -> list[TableLookups]:
    """The embedding lookups of ``task``'s first ``steps`` batches on every rank."""
    batches = [[task.batch(r, world_size, s)[0] for r in range(world_size)] for s in range(steps)]
    return measure_lookups(model, batches, world_size)
