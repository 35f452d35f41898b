"""Bad input to ``thinwire.parallelize`` across ranks fails before training, on every rank,
with a message naming what differs; a rank that dies mid-step makes the others raise
:class:`~thinwire.CommunicationError` within the timeout instead of hanging."""

from __future__ import annotations

import time

import pytest
import torch

from thinwire import CommunicationError, RankMismatchError
from thinwire.launch import LocalPool
from thinwire.parallel import ParallelPlan, parallelize
from thinwire.tasks.transformer import TransformerConfig, TransformerLM

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORLD = 4
TIMEOUT_S = 4.0


def _model(seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(TransformerConfig(style="llama", vocab=32, dim=16, layers=4, heads=2))


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def _outcome(fn) -> tuple[str, str]:
    """``("ok", "")`` or the exception's class name and message."""
    try:
        fn()
    except Exception as error:
        return type(error).__name__, str(error)
    return "ok", ""


def different_plan_on_rank_2(rank: int, world: int) -> tuple[str, str]:
    microbatches = 4 if rank == 2 else 2
    plan = ParallelPlan(dp=2, pp=2, microbatches=microbatches)
    return _outcome(lambda: parallelize(_model(), plan, optimizer=_optimizer))


def different_weights_on_rank_1(rank: int, world: int) -> tuple[str, str]:
    plan = ParallelPlan(dp=2, tp=2)
    return _outcome(lambda: parallelize(_model(seed=rank == 1), plan, optimizer=_optimizer))


def different_batch_on_rank_3(rank: int, world: int) -> tuple[str, str]:
    trainer = parallelize(_model(), ParallelPlan(dp=2, pp=2, microbatches=2), optimizer=_optimizer)
    seed = 1 if rank == 3 else 0
    tokens = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(seed))
    return _outcome(lambda: trainer.step(tokens[:, :-1], tokens[:, 1:]))


def rank_3_stalls_in_step_2(rank: int, world: int) -> tuple[str, str, float]:
    """Rank 3 stops taking part (as a dead or hung peer does) for longer than the timeout;
    the others time their second step."""
    trainer = parallelize(_model(), ParallelPlan(pp=2, tp=2, microbatches=2), optimizer=_optimizer)
    tokens = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))
    trainer.step(tokens[:, :-1], tokens[:, 1:])
    if rank == 3:
        time.sleep(TIMEOUT_S * 2.5)
        return "stalled", "", 0.0
    start = time.monotonic()
    kind, message = _outcome(lambda: trainer.step(tokens[:, :-1], tokens[:, 1:]))
    return kind, message, time.monotonic() - start


@pytest.fixture(scope="module")
def pool():
    with LocalPool(WORLD, collective_timeout_s=TIMEOUT_S) as local:
        yield local


def test_a_plan_that_differs_between_ranks_is_refused_on_every_rank(pool) -> None:
    for kind, message in pool.run(different_plan_on_rank_2, timeout=120):
        assert kind == "RankMismatchError", message
    assert "rank(s) 2 run a different one" in pool_message(pool, different_plan_on_rank_2, 0)


def pool_message(pool, fn, rank: int) -> str:
    return pool.run(fn, timeout=120)[rank][1]


def test_models_that_start_from_different_weights_are_refused(pool) -> None:
    results = pool.run(different_weights_on_rank_1, timeout=120)
    assert all(kind == RankMismatchError.__name__ for kind, _ in results)
    assert "differ in their starting weights" in results[0][1]
    assert "torch.manual_seed" in results[0][1]


def test_ranks_given_different_batches_are_refused_at_the_first_step(pool) -> None:
    results = pool.run(different_batch_on_rank_3, timeout=120)
    assert all(kind == RankMismatchError.__name__ for kind, _ in results)
    assert "rank(s) 3 were given different global batches" in results[0][1]


def test_a_stalled_rank_makes_the_others_raise_within_the_timeout() -> None:
    with LocalPool(WORLD, collective_timeout_s=TIMEOUT_S) as stalled:
        outcomes = stalled.run(rank_3_stalls_in_step_2, timeout=120)
        stalled.close(force=True)  # its groups are out of step now
    for kind, message, waited in outcomes[:3]:
        assert kind == CommunicationError.__name__, message
        assert waited < TIMEOUT_S * 2, f"waited {waited:.1f} s"
        assert "timeout" in message
