"""A stage's exchange put together from its parts' as the engine runs it: buckets, and each
bucket's later rounds fused with the next bucket's first."""

from __future__ import annotations

import pytest
import torch

from thinwire.compress.registry import compressor
from thinwire.plan.cost import BucketCost, MethodCost
from thinwire.plan.network import ALLGATHER, ALLREDUCE, Collective
from thinwire.plan.profile_buckets import Bucket
from thinwire.plan.profile_exchangers import ThinwireEngine
from thinwire.plan.stage_buckets import fused_calls, merged_bucket, rebucketed, rounds_of


def _engine_step(method: str, options: dict, shapes_by_bucket: list[list[tuple[int, ...]]]):
    """What thinwire's engine issues for one step over these buckets, rounds fused (as
    ``DistributedOptimizer`` runs it): each bucket's call's collectives and rounds."""
    engine = ThinwireEngine(compressor(method, **options), world=4, fuse_rounds=True)
    generator = torch.Generator().manual_seed(0)
    buckets = [
        Bucket(i, [(f"b{i}p{j}", torch.zeros(s)) for j, s in enumerate(shapes)])
        for i, shapes in enumerate(shapes_by_bucket)
    ]
    calls = []
    for run in range(2):  # the second step: past any first-step special case
        calls = []
        for bucket in buckets:
            bucket.fill(generator)
            sent = engine(bucket, run, last=bucket is buckets[-1])
            calls.append((tuple(sent), engine.last_rounds))
    return calls


SHAPES = [[(64, 48), (48,)], [(96, 32)], [(40, 40), (40, 8)], [(128, 16)]]


def test_the_engine_records_each_round_of_a_bucket_alone():
    ((sent, rounds),) = _engine_step("powersgd", {"rank": 2}, SHAPES[:1])
    assert [c.kind for c in sent] == [ALLREDUCE, ALLREDUCE] and rounds == (1, 1)  # P, then Q
    ((sent, rounds),) = _engine_step("dgc", {"density": 0.1, "warmup_steps": 0}, SHAPES[:1])
    assert len(sent) == 1 and sent[0].kind == ALLGATHER and rounds == (1,)


@pytest.mark.parametrize("method,options", [("powersgd", {"rank": 2}), ("dgc", {"density": 0.1})])
def test_fused_buckets_issue_what_the_engine_issues(method, options):
    alone = []
    for shapes in SHAPES:  # each bucket measured alone, as the planner measures a part
        ((sent, rounds),) = _engine_step(method, options, [shapes])
        alone.append(BucketCost(1.0, 0.0, sent, rounds=rounds))
    modelled = fused_calls([rounds_of(b) for b in alone])
    engine = _engine_step(method, options, SHAPES)  # the same buckets in one fused step
    issued = [c for sent, _ in engine for c in sent]
    assert [c for call in modelled for c in call] == issued
    rounds = max(len(b.rounds) for b in alone)
    assert len(issued) == len(SHAPES) + rounds - 1  # one a bucket plus one, not 2 a bucket
    total = sum(c.nbytes for b in alone for c in b.collectives)
    assert sum(c.nbytes for c in issued) == total  # nothing lost, nothing sent twice


def test_calls_run_a_round_of_every_bucket_in_flight_one_collective_per_kind():
    p, q = Collective(ALLREDUCE, 100), Collective(ALLREDUCE, 10)
    gather = Collective(ALLGATHER, 7)
    calls = fused_calls([[[p], [q]], [[p], [q]], [[gather]]])
    assert calls == [
        [p],
        [Collective(ALLREDUCE, 110)],  # bucket 0's Q with bucket 1's P
        [q, gather],  # bucket 1's Q beside bucket 2's one round
    ]
    assert fused_calls([[[p], [q]]]) == [[p], [q]]  # one bucket: its rounds in turn
    assert fused_calls([[], [[p]]]) == [[], [p]]  # a bucket that sends nothing still calls


def _part(numel: int, rounds: tuple[int, ...] = ()) -> MethodCost:
    collectives = tuple(Collective(ALLREDUCE, numel // 10) for _ in rounds or (1, 1))
    bucket = BucketCost(1.0, 0.01, collectives, numel=numel, rounds=rounds)
    return MethodCost("powersgd", (bucket,), dense_bytes=numel * 4)


def test_a_stage_of_parts_costs_one_collective_a_bucket_plus_one():
    parts = [_part(4_000_000, (1, 1)) for _ in range(8)]  # 16 MB each: a bucket of 2 then 1
    stage = rebucketed(parts)
    assert stage is not None
    buckets = stage.buckets
    assert len(buckets) == 5  # 16 MB >= the first 1 MiB; then 25 MiB holds two parts
    collectives = [c for b in buckets for c in b.collectives]
    assert len(collectives) == len(buckets) + 1  # the last bucket keeps the final Q
    assert sum(c.nbytes for c in collectives) == sum(
        c.nbytes for p in parts for b in p.buckets for c in b.collectives
    )
    assert buckets[-1].rounds == (1, 1) and all(b.rounds == (1,) for b in buckets[:-1])
    assert sum(b.compress_s for b in buckets) == pytest.approx(0.08)
    assert stage.dense_bytes == 8 * 16_000_000
    # a bucket that does not say how its collectives fall into rounds: one a round
    assert rebucketed([_part(4_000_000)]).buckets[0].rounds == (1, 1)
    assert rebucketed([]) is None


def test_merging_parts_keeps_their_rounds_and_refuses_rounds_that_do_not_add_up():
    merged = merged_bucket([_part(100, (1, 1)).buckets[0], _part(300, (1, 1)).buckets[0]])
    assert merged.rounds == (1, 1) and [c.nbytes for c in merged.collectives] == [40, 40]
    with pytest.raises(ValueError, match="rounds"):
        BucketCost(1.0, 0.0, (Collective(ALLREDUCE, 1),), rounds=(1, 1))
