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
