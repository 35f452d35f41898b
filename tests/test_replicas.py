"""Rank 0's tensors copied to every rank, only where some rank's bytes differ."""

from __future__ import annotations

import pytest
import torch

from thinwire.comm.replicas import tensor_digest
from thinwire.launch import LocalPool


@pytest.fixture(scope="module")
def pool():
    with LocalPool(2) as made:
        yield made


def _copy(rank: int, world: int, perturbed: list[str]) -> tuple[list[str], list[list[float]]]:
    import torch.distributed as dist

    from thinwire.comm.replicas import broadcast_where_different

    torch.manual_seed(0)
    named = [(name, torch.randn(3)) for name in ("a", "b", "c")]
    if rank == 1:
        for name, tensor in named:
            if name in perturbed:
                tensor.add_(1.0)
    sent = broadcast_where_different(named, root=0, group=dist.group.WORLD)
    return sent, [t.tolist() for _, t in named]


@pytest.mark.timeout(120)
def test_replicas_that_agree_send_nothing_but_their_digests(pool) -> None:
    (sent0, values0), (sent1, values1) = pool.run(_copy, [], timeout=90)
    assert sent0 == sent1 == []
    assert values0 == values1


@pytest.mark.timeout(120)
def test_only_the_tensors_that_differ_travel_and_then_agree(pool) -> None:
    (sent0, values0), (sent1, values1) = pool.run(_copy, ["b"], timeout=90)
    assert sent0 == sent1 == ["b"]  # every rank takes part in the same broadcasts
    assert values0 == values1  # rank 1's "b" is now rank 0's


def _optimizer_weights(rank: int, world: int) -> list[float]:
    import thinwire

    torch.manual_seed(rank)  # replicas built apart
    model = torch.nn.Linear(3, 2)
    thinwire.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


@pytest.mark.timeout(120)
def test_the_wrapper_starts_every_rank_from_rank_0s_weights(pool) -> None:
    first, second = pool.run(_optimizer_weights, timeout=90)
    assert first == second
    torch.manual_seed(0)
    assert first == [v for p in torch.nn.Linear(3, 2).parameters() for v in p.flatten().tolist()]


def test_a_digest_tells_values_and_dtypes_apart() -> None:
    zeros = torch.zeros(4)
    assert tensor_digest(zeros) == tensor_digest(torch.zeros(4))
    assert tensor_digest(zeros) != tensor_digest(torch.tensor([0.0, 0.0, 0.0, 1e-30]))
    assert tensor_digest(zeros) != tensor_digest(torch.zeros(4, dtype=torch.int32))  # same bytes
    assert tensor_digest(torch.arange(6.0).reshape(2, 3).t()) == tensor_digest(
        torch.tensor([0.0, 3.0, 1.0, 4.0, 2.0, 5.0])
    )  # values in order, whatever the strides
