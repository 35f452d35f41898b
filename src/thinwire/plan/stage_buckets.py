"""A stage's data-parallel exchange, put together from its parts' exchanges as the engine
runs it: the parts' gradients in DDP's buckets, and each bucket's later rounds fused with
the next bucket's first.

The planner measures each part's exchange alone, as one bucket
(:func:`thinwire.plan.model_costs.measure_exchanges`), so that any stage is a sum of
parts. :func:`rebucketed` then buckets a stage as the engine does (from the last part, a
first bucket of 1 MiB, then 25 MiB each; :func:`merged_bucket`) and schedules the buckets'
rounds as ``DistributedOptimizer`` and the DDP hook send them with ``fuse_rounds`` (their
default, :meth:`thinwire.comm.engine.GradientExchange.exchange_fused`): every call starts a
bucket and runs one round of every bucket still in flight, one collective per kind, and the
last call runs rounds until none is left (:func:`fused_calls`). A protocol of ``R`` rounds
over ``B`` buckets then costs ``B + R - 1`` collectives, not ``B * R``: PowerSGD (P, then
Q) over four buckets five all-reduces, not eight, and the latency of three 8-rank rings
(0.15 s at 10 Mbit/s and 1 ms) the engine does not pay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from thinwire.data_parallel.buckets import MB
from thinwire.plan.cost import BucketCost, MethodCost
from thinwire.plan.network import Collective
from thinwire.plan.profile_buckets import BUCKET_CAP_MB, FIRST_BUCKET_MB

#: one bucket's protocol: its rounds in order, each the collectives that round issues
Rounds = list[list[Collective]]


def round_sizes(bucket: BucketCost) -> tuple[int, ...]:
    """How many collectives each of ``bucket``'s rounds issues (:attr:`BucketCost.rounds`;
    a bucket that does not say issues one a round)."""
    return bucket.rounds or (1,) * len(bucket.collectives)


def rounds_of(bucket: BucketCost) -> Rounds:
    """``bucket``'s collectives round by round (:func:`round_sizes`)."""
    rounds, start = [], 0
    for size in round_sizes(bucket):
        rounds.append(list(bucket.collectives[start : start + size]))
        start += size
    return rounds


def merged_bucket(buckets: Sequence[BucketCost]) -> BucketCost:
    """One bucket holding ``buckets``' gradients: their compression times and sizes add up,
    and their collectives, round by round, become one each (same kinds) or run in turn."""
    rounds = [b.collectives for b in buckets]
    alike = len({tuple(c.kind for c in r) for r in rounds}) == 1
    if alike and len(set(map(round_sizes, buckets))) == 1:
        collectives = tuple(
            Collective(parts[0].kind, sum(c.nbytes for c in parts))
            for parts in zip(*rounds, strict=True)
        )
        sizes = buckets[0].rounds
    else:
        collectives = tuple(c for r in rounds for c in r)
        sizes = tuple(n for b in buckets for n in round_sizes(b))
    return BucketCost(
        ready=max(b.ready for b in buckets),
        compress_s=sum(b.compress_s for b in buckets),
        collectives=collectives,
        numel=sum(b.numel for b in buckets),
        rounds=sizes,
    )


def _one_per_kind(collectives: Sequence[Collective]) -> list[Collective]:
    """What one call's requests travel as: one collective per kind, in the order the
    kinds first come (each kind's bytes added up)."""
    total: dict[str, int] = {}
    for collective in collectives:
        total[collective.kind] = total.get(collective.kind, 0) + collective.nbytes
    return [Collective(kind, nbytes) for kind, nbytes in total.items()]


def fused_calls(buckets: Sequence[Rounds]) -> list[list[Collective]]:
    """The collectives of each call of a fused step over ``buckets`` (each its rounds in
    order): call ``i`` starts bucket ``i`` and runs the next round of every bucket in
    flight; after the last bucket's call, calls run until every bucket is done."""
    calls: list[list[Collective]] = []
    in_flight: list[list[list[Collective]]] = []

    def call() -> None:
        sent = [c for rounds in in_flight if rounds for c in rounds.pop(0)]
        in_flight[:] = [rounds for rounds in in_flight if rounds]
        calls.append(_one_per_kind(sent))

    for rounds in buckets:
        in_flight.append(list(rounds))
        call()
    while in_flight:
        call()
    return calls


def rebucketed(parts: Sequence[MethodCost]) -> MethodCost | None:
    """The exchange of a stage made of ``parts`` (each measured as one bucket), bucketed as
    the engine buckets the stage: from the last part (its gradients are ready first), a
    bucket closes once it holds DDP's first limit (1 MiB), then 25 MiB each; each bucket's
    later rounds fused with the next one's first (:func:`fused_calls`: the collectives
    of the calls after the last bucket's own are the last bucket's)."""
    if not parts:
        return None
    limits = [int(FIRST_BUCKET_MB * MB), int(BUCKET_CAP_MB * MB)]
    buckets: list[BucketCost] = []
    current: list[BucketCost] = []
    for part in reversed(parts):
        for bucket in part.buckets:
            current.append(bucket)
            if sum(b.numel for b in current) * 4 >= limits[min(len(buckets), 1)]:
                buckets.append(merged_bucket(current))
                current = []
    if current:
        buckets.append(merged_bucket(current))
    calls = fused_calls([rounds_of(b) for b in buckets])
    fused = []
    for i, bucket in enumerate(buckets):
        own = calls[i:] if i == len(buckets) - 1 else calls[i : i + 1]
        collectives = tuple(c for call in own for c in call)
        fused.append(replace(bucket, collectives=collectives, rounds=tuple(map(len, own))))
    return replace(parts[0], buckets=tuple(fused), dense_bytes=sum(p.dense_bytes for p in parts))
