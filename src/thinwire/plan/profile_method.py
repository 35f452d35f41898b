"""Measure one method's traffic and compression time, in this process.

:func:`measure_method`: per bucket, the collectives a method issues (kind and bytes) and
the CPU time of its compression and decompression, on random gradients of the model's real
shapes; for the embedding methods, also the tables' traffic, from the ids the task's
batches look up (:mod:`thinwire.plan.embedding`). thinwire's methods run through
thinwire's own exchange engine (memory, protocols, rounds fused across buckets); PyTorch's
hooks by calling them (:mod:`thinwire.plan.profile_torch_hooks`).
Gathered payloads are decoded ``world_size`` times, as every rank decodes every rank's
payload.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from thinwire.data_parallel.buckets import BucketSpec
from thinwire.plan.cost import BucketCost, MethodCost
from thinwire.plan.embedding import TableLookups, table_traffic
from thinwire.plan.network import Collective
from thinwire.plan.profile_buckets import BUCKET_CAP_MB, NamedTensors, bucket_groups, ddp_buckets
from thinwire.plan.profile_compute import ComputeProfile, one_thread
from thinwire.plan.profile_exchangers import Bucket, Exchanger, ThinwireEngine, build_exchanger
from thinwire.strategies import strategy


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
    chosen = strategy(method)
    opts = chosen.options(options)
    params = [(n, p) for n, p in params]
    if chosen.costing == "embedding":
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
    if chosen.costing == "none":
        return MethodCost(method, (), dense_bytes, opts)
    order = compute.order if compute is not None else None
    if chosen.costing == "wrapper":
        return _wrapper_cost(method, chosen.schedule, opts, params, world_size, repeats, seed)
    if chosen.costing == "torch-powersgd":
        # thinwire bench runs PyTorch's PowerSGD hook with one bucket on gloo (its
        # callback-issued all-reduces race between buckets there): model it that way
        groups = [[n for n, _ in reversed(params)] if order is None else list(order)]
    else:
        groups = bucket_groups(params, order, bucket_cap_mb)
    exchanger = build_exchanger(chosen.costing, method, opts, world_size, fuse_rounds)
    ready_of = (lambda names: max(compute.ready[n] for n in names)) if compute else None
    buckets = _measure_buckets(
        params, groups, exchanger, repeats, seed, ready_of, timed=chosen.costing != "dense"
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
    schedule: str,
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
    exchanger = ThinwireEngine(
        build(options["compressor"], **options["compressor_options"]),
        world_size,
        fuse_rounds=False,  # DGA and the parameter server exchange each bucket alone
    )
    timed = options["compressor"] != "none"
    buckets = _measure_buckets(params, groups, exchanger, repeats, seed, None, timed=timed)
    dense_bytes = sum(p.numel() * 4 for _, p in params)
    return MethodCost(method, tuple(buckets), dense_bytes, options, schedule=schedule)


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
    """Run ``exchanger`` on the buckets of ``groups``, in order, for its warm-up steps (one,
    or its ``warmup_runs``) and ``repeats`` timed steps on fresh random gradients: each
    bucket's collectives and, if ``timed``, its median compression time;
    ``ready_of(names)`` is when the bucket is ready (default: 1.0). The collectives are
    those of the timed step that sent the most: a compressor whose traffic alternates
    between steps (``powersgd-oneround`` with ``alternate``) is modelled at its heavier
    step whatever ``repeats`` is."""
    by_name = dict(params)
    generator = torch.Generator().manual_seed(seed)
    buckets = [
        Bucket(index, [(n, by_name[n]) for n in names]) for index, names in enumerate(groups)
    ]
    times: list[list[float]] = [[] for _ in buckets]
    steps: list[list[list[Collective]]] = []
    rounds: list[list[tuple[int, ...]]] = []  # per step and bucket: collectives a round
    warmup = getattr(exchanger, "warmup_runs", 1)  # PyTorch's PowerSGD starts dense
    with one_thread():
        for run in range(warmup + repeats):
            step: list[list[Collective]] = []
            step_rounds: list[tuple[int, ...]] = []
            for bucket in buckets:
                bucket.fill(generator)
                started = time.perf_counter()
                step.append(exchanger(bucket, run, bucket is buckets[-1]))
                if run >= warmup:
                    times[bucket.index].append(time.perf_counter() - started)
                step_rounds.append(getattr(exchanger, "last_rounds", ()))
            if run >= warmup:
                steps.append(step)
                rounds.append(step_rounds)
    heaviest = max(range(len(steps)), key=lambda i: sum(c.nbytes for b in steps[i] for c in b))
    collectives = steps[heaviest]
    return [
        BucketCost(
            ready_of(names) if ready_of is not None and names else 1.0,
            statistics.median(times[bucket.index]) if timed else 0.0,
            tuple(collectives[bucket.index]),
            bucket.numel,
            rounds=rounds[heaviest][bucket.index],
        )
        for bucket, names in zip(buckets, groups, strict=True)
    ]
