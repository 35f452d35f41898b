"""Counts: how many collectives and bytes one step issues (fusion: one per bucket and round)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import thinwire

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def one_step_traffic(rank: int, world: int, compressor: str, options: dict) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 10))  # 2 weights, 2 biases
    opt = thinwire.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, compressor, bucket_cap_mb=25, **options
    )
    model(torch.randn(8, 100)).sum().backward()
    opt.step()
    return opt.last_step.as_dict()


def test_dense_step_is_one_allreduce_of_every_gradient(pool2) -> None:
    stats = pool2.run(one_step_traffic, "none", {})[0]
    numel = 100 * 50 + 50 + 50 * 10 + 10
    assert stats["collectives"] == 1
    assert stats["payload_bytes"] == numel * 4
    assert stats["sent_bytes"] == numel * 4  # ring all-reduce: 2 (N-1)/N = 1 for N = 2
    assert stats["compression_ratio"] == 1.0


def test_topk_step_is_one_fused_allgather(pool2) -> None:
    stats = pool2.run(one_step_traffic, "topk", {"density": 0.01})[0]
    k_total = 50 + 5  # 1 % of 5000 and of 500
    dense_biases = 50 + 10
    status_byte = 1
    assert stats["collectives"] == 1
    assert stats["payload_bytes"] == k_total * (4 + 4) + dense_biases * 4 + status_byte
    assert stats["sent_bytes"] == stats["payload_bytes"]  # all-gather: (N-1) x payload


def optimizer_powersgd_step(rank: int, world: int, fuse: bool) -> tuple[int, list]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 10))
    opt = thinwire.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        "powersgd",
        bucket_cap_mb=0.01,  # two buckets: the last layer and biases, then the 50x100 weight
        fuse_rounds=fuse,
    )
    torch.manual_seed(rank)
    model(torch.randn(8, 100)).sum().backward()
    opt.synchronize()
    return opt.last_step.collectives, [p.grad.clone() for p in model.parameters()]


def test_optimizer_wrapper_fuses_a_buckets_q_round_with_the_next_buckets_p(pool2) -> None:
    fused = pool2.run(optimizer_powersgd_step, True)
    alone = pool2.run(optimizer_powersgd_step, False)
    assert [count for count, _ in alone] == [4, 4]  # P and Q of each of two buckets
    assert [count for count, _ in fused] == [3, 3]  # P0 | Q0 + P1 | Q1
    for (_, got), (_, want) in zip(fused, alone):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def direct_against_ring(rank: int, world: int, compressor: str, options: dict) -> tuple:
    """One step through the direct (all-to-all) communicator and through the default ring
    one: each step's statistics and averaged gradients."""
    results = []
    for communicator in ("direct", "auto"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 10))
        opt = thinwire.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model,
            compressor,
            communicator=communicator,
            **options,
        )
        torch.manual_seed(1 + rank)
        model(torch.randn(8, 100)).sum().backward()
        opt.synchronize()
        results.append((opt.last_step.as_dict(), [p.grad.clone() for p in model.parameters()]))
    return results


@pytest.mark.parametrize(
    ("compressor", "options"), [("topk", {"density": 0.01}), ("powersgd", {"rank": 2})]
)
def test_direct_communicator_averages_the_same_in_one_collective_per_round(
    pool2, compressor: str, options: dict
) -> None:
    for (direct, direct_grads), (ring, ring_grads) in pool2.run(
        direct_against_ring, compressor, options
    ):
        assert direct["collectives"] == (1 if compressor == "topk" else 2)  # one per round
        assert direct["collectives"] == ring["collectives"]
        if compressor == "topk":  # both gather: the same bytes, plus one status byte
            assert direct["payload_bytes"] == ring["payload_bytes"]
        for a, b in zip(direct_grads, ring_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
