"""After ``backward()`` returns, thinwire's view of the step is final.

DDP waits for every bucket's future at the end of the backward pass; the hook must close
the engine's step (statistics, counter, committed error feedback) before the last future
resolves, or ``engine.last_step``, ``engine.step`` and ``engine.state_dict()`` read right
after ``backward()`` lag one step behind (and a checkpoint holds the wrong step's state).
A slow ``end_step`` makes the race certain rather than likely.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import thinwire

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

CASES = [
    ("powersgd", {"rank": 2, "min_compression": 1.0}, True),
    ("dgc", {"density": 0.05}, True),
    ("randomk", {"density": 0.1}, True),
    ("none", {}, True),
    ("powersgd", {"rank": 2, "min_compression": 1.0}, False),
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 32), nn.Linear(32, 4))


def _slowed(engine: thinwire.GradientExchange, seconds: float) -> None:
    """Make the engine take ``seconds`` longer to close each step."""
    original = engine.end_step

    def slow_end_step():  # type: ignore[no-untyped-def]
        time.sleep(seconds)
        return original()

    engine.end_step = slow_end_step  # type: ignore[method-assign]


def step_seen_after_backward(
    rank: int, world: int, name: str, options: dict, fuse: bool
) -> list[tuple[int, int | None]]:
    """Per step, right after ``backward()``: the engine's counter and ``last_step.step``."""
    model = DDP(_model(), bucket_cap_mb=0.004)  # several buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = thinwire.register(model, name, fuse_rounds=fuse, **options)
    _slowed(engine, 0.05)
    gen = torch.Generator().manual_seed(rank)
    seen = []
    for _ in range(6):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        last = engine.last_step
        seen.append((engine.step, None if last is None else last.step))
        opt.step()
    return seen


@pytest.mark.parametrize(("name", "options", "fuse"), CASES)
def test_step_is_closed_when_backward_returns(pool2, name, options, fuse) -> None:
    for seen in pool2.run(step_seen_after_backward, name, options, fuse):
        assert [s[0] for s in seen] == [1, 2, 3, 4, 5, 6]
        assert [s[1] for s in seen] == [0, 1, 2, 3, 4, 5]


def state_right_after_loop(rank: int, world: int) -> bool:
    """``state_dict()`` taken right after the loop holds the last step's residuals: equal
    to the one taken after waiting for the exchange thread to go idle."""
    model = DDP(_model(), bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = thinwire.register(model, "powersgd", rank=1, min_compression=1.0)
    _slowed(engine, 0.05)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    early = engine.state_dict()
    snapshot = {k: v.clone() for k, v in early["memory"]["residuals"].items()}
    step = early["step"]
    engine.submit(lambda: None).wait()  # the exchange thread is idle now
    late = engine.state_dict()
    same = all(
        np.array_equal(snapshot[k].numpy(), v.numpy())
        for k, v in late["memory"]["residuals"].items()
    )
    return step == late["step"] == 4 and same


def test_state_dict_after_the_loop_holds_the_last_step(pool2) -> None:
    assert all(pool2.run(state_right_after_loop))


# -- one checkpoint object for every rank's state -------------------------------------------


def _train(model: DDP, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _job(name: str, options: dict) -> tuple[DDP, torch.optim.Optimizer, thinwire.GradientExchange]:
    model = DDP(_model(), bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, opt, thinwire.register(model, name, **options)


def resume_from_rank0_copy(rank: int, world: int, name: str, options: dict, path: str) -> bool:
    """Save as a framework does (every rank gathers, rank 0 writes), resume every rank from
    that one file, and end on the weights of the uninterrupted run, bit for bit."""
    model, opt, engine = _job(name, options)
    _train(model, opt, rank, range(6))
    straight = [p.detach().clone() for p in model.parameters()]

    model, opt, engine = _job(name, options)
    _train(model, opt, rank, range(3))
    full = engine.full_state_dict()  # collective
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "thinwire": full}, path)
    torch.distributed.barrier()
    saved = torch.load(path, weights_only=True)
    model, opt, engine = _job(name, options)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    engine.load_state_dict(saved["thinwire"])
    _train(model, opt, rank, range(3, 6))
    return engine.step == 6 and all(
        torch.equal(a, b) for a, b in zip(straight, model.parameters(), strict=True)
    )


@pytest.mark.parametrize(
    ("name", "options"),
    [("dgc", {"density": 0.05}), ("powersgd", {"rank": 1}), ("randomk", {"density": 0.1})],
)
def test_one_file_resumes_every_rank_exactly(pool2, tmp_path, name, options) -> None:
    assert all(pool2.run(resume_from_rank0_copy, name, options, str(tmp_path / "ckpt.pt")))


def resume_on_rank0_only(rank: int, world: int, path: str) -> str:
    """Only rank 0 loads the thinwire state: every rank must refuse the next step."""
    model, opt, engine = _job("randomk", {"density": 0.1})
    _train(model, opt, rank, range(2))
    full = engine.full_state_dict()
    if rank == 0:
        torch.save(full, path)
    torch.distributed.barrier()
    model, opt, engine = _job("randomk", {"density": 0.1})
    if rank == 0:
        engine.load_state_dict(torch.load(path, weights_only=True))
    try:
        _train(model, opt, rank, range(2, 3))
    except RuntimeError as error:
        return str(error)
    return "trained on"


def test_a_resume_of_some_ranks_raises_on_every_rank(pool2, tmp_path) -> None:
    for message in pool2.run(resume_on_rank0_only, str(tmp_path / "full.pt")):
        assert "RankMismatchError" in message and "different points" in message


def wrong_world_size(rank: int, world: int) -> str:
    """An all-ranks state of another job size is refused with what to do."""
    _, _, engine = _job("dgc", {"density": 0.05})
    full = engine.full_state_dict()
    full = {**full, "world_size": 3, "ranks": [*full["ranks"], full["ranks"][0]]}
    try:
        engine.load_state_dict(full)
    except ValueError as error:
        return str(error)
    return "loaded"


def test_an_all_ranks_state_of_another_size_is_refused(pool2) -> None:
    for message in pool2.run(wrong_world_size):
        assert "holds the state of 3 ranks" in message and "this job has 2" in message
