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


def _ddp_start(rank: int, world: int, seed_by_rank: bool) -> tuple[list[str], list[float], dict]:
    from thinwire.strategies import base

    copies: list[list[str]] = []
    built: dict = {}
    copy, ddp_class = base.copy_module_states, base.DistributedDataParallel

    def recorded_copy(*args, **kwargs):
        copies.append(copy(*args, **kwargs))
        return copies[-1]

    def recorded_ddp(module, **kwargs):
        built.update(kwargs)
        return ddp_class(module, **kwargs)

    base.copy_module_states, base.DistributedDataParallel = recorded_copy, recorded_ddp
    try:
        torch.manual_seed(rank if seed_by_rank else 0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        if seed_by_rank:
            model[1].running_mean.fill_(float(rank))
        ddp = base.WrapSetup().ddp(model)
    finally:
        base.copy_module_states, base.DistributedDataParallel = copy, ddp_class
    values = [v for t in ddp.module.state_dict().values() for v in t.flatten().tolist()]
    return copies[0], values, {"init_sync": built.get("init_sync")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed_by_rank", [False, True])
def test_ddp_starts_from_rank_0s_model_sending_only_what_differs(pool, seed_by_rank) -> None:
    (sent0, values0, built0), (sent1, values1, built1) = pool.run(
        _ddp_start, seed_by_rank, timeout=90
    )
    assert values0 == values1
    assert built0 == built1 == {"init_sync": False}  # DDP's whole-model copy skipped
    expected = ["0.weight", "0.bias", "1.running_mean"] if seed_by_rank else []
    assert sent0 == sent1 == expected  # BatchNorm's own weights start equal on every rank


def _ddp_start_asked(rank: int, world: int) -> tuple[bool, list[float]]:
    """``WrapSetup.ddp`` with the caller's own ``init_sync=True`` (``extra`` overrides)."""
    from thinwire.strategies import base

    torch.manual_seed(rank)  # the ranks start apart: DDP's own copy makes them equal
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ddp = base.WrapSetup().ddp(model, init_sync=True, broadcast_buffers=False)
    values = [v for t in ddp.module.state_dict().values() for v in t.flatten().tolist()]
    return ddp.broadcast_buffers, values


@pytest.mark.timeout(120)
def test_the_callers_own_ddp_options_override_the_setups(pool) -> None:
    (buffers0, values0), (buffers1, values1) = pool.run(_ddp_start_asked, timeout=90)
    assert values0 == values1 and buffers0 is buffers1 is False


def _ignored_stay_apart(rank: int, world: int) -> tuple[list[str], list[float]]:
    from torch.nn.parallel import DistributedDataParallel

    from thinwire.comm.replicas import copy_module_states

    torch.manual_seed(rank)  # every tensor differs between the ranks
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2 + rank))
    # the second layer is this rank's own (a shard: even its shape differs)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ["1.weight", "1.bias"]
    )
    return copy_module_states(model), model[1].weight.flatten().tolist()


@pytest.mark.timeout(120)
def test_what_ddp_ignores_is_neither_checked_nor_copied(pool) -> None:
    (sent0, own0), (sent1, own1) = pool.run(_ignored_stay_apart, timeout=90)
    assert sent0 == sent1 == ["0.weight", "0.bias"]
    assert len(own0) == 8 and len(own1) == 12  # each rank keeps its own shard


def _mismatched_layout(rank: int, world: int) -> str:
    from thinwire.errors import RankMismatchError
    from thinwire.strategies.base import WrapSetup

    model = torch.nn.Linear(3, 2 + rank)
    try:
        WrapSetup().ddp(model)
    except RankMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(120)
def test_ddp_refuses_models_of_another_shape_on_every_rank(pool) -> None:
    for message in pool.run(_mismatched_layout, timeout=90):
        assert "differ in their parameters or buffers" in message
        assert "build the same model on every rank" in message


def test_a_digest_tells_values_and_dtypes_apart() -> None:
    zeros = torch.zeros(4)
    assert tensor_digest(zeros) == tensor_digest(torch.zeros(4))
    assert tensor_digest(zeros) != tensor_digest(torch.tensor([0.0, 0.0, 0.0, 1e-30]))
    assert tensor_digest(zeros) != tensor_digest(torch.zeros(4, dtype=torch.int32))  # same bytes
    assert tensor_digest(torch.arange(6.0).reshape(2, 3).t()) == tensor_digest(
        torch.tensor([0.0, 3.0, 1.0, 4.0, 2.0, 5.0])
    )  # values in order, whatever the strides
