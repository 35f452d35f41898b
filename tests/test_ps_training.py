"""The parameter server: sync is all-reduce SGD, async keeps its bound, checkpoints resume."""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import thinwire
from ps_cases import STEPS, Run, build_server, seeded_model, worker_batch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def train(rank: int, world: int, run: Run) -> dict[str, Any]:
    """Train ``run.steps`` steps of SGD on this rank's batches; return the final weights
    (as pulled, or after the all-reduce step) and, on a server rank, its logs."""
    model = seeded_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=run.momentum)
    if run.front_end == "allreduce":
        opt: Any = thinwire.DistributedOptimizer(sgd, model, run.compressor, **run.options)
        worker = rank
    else:
        opt = thinwire.ParameterServer(
            sgd,
            model,
            run.compressor,
            mode=run.mode,
            servers=run.servers,
            colocated=run.colocated,
            staleness=run.staleness,
            **run.options,
        )
        worker = opt.worker_index
    if run.front_end == "allreduce" or opt.is_worker:
        for step in range(run.steps):
            if run.slow_rank_sleep and worker == 0:
                time.sleep(run.slow_rank_sleep)
            x, y = worker_batch(worker, step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    result: dict[str, Any] = {"weights": _flat(model), "worker": worker}
    if run.front_end == "ps":
        opt.close()
        result["is_worker"] = opt.is_worker
        if opt.server is not None:
            result["applied"] = list(opt.server.applied)
            result["released"] = list(opt.server.released)
    return result


def _reference(workers: int, steps: int, momentum: float) -> np.ndarray:
    """Single-process SGD on the mean of every worker's gradient: what sync must equal."""
    model = seeded_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for step in range(steps):
        sgd.zero_grad()
        for worker in range(workers):
            x, y = worker_batch(worker, step)
            (nn.functional.mse_loss(model(x), y) / workers).backward()
        sgd.step()
    return _flat(model)


@pytest.mark.parametrize(
    "servers,colocated",
    [(1, True), (2, True), (1, False)],
    ids=["1-colocated", "2-colocated", "1-dedicated"],
)
def test_synchronous_server_gives_the_weights_of_allreduce_sgd(pool, servers, colocated) -> None:
    world = pool.world_size
    if servers >= world and not colocated:
        pytest.skip("needs a worker beside the server")
    results = pool.run(train, Run(servers=servers, colocated=colocated))
    workers = [r for r in results if r["is_worker"]]
    assert len(workers) == (world if colocated else world - servers)
    expected = _reference(len(workers), STEPS, momentum=0.9)
    for result in workers:
        np.testing.assert_allclose(result["weights"], expected, rtol=1e-5, atol=1e-6)
    # the weights moved: the comparison is not between two untrained models
    assert np.abs(expected - _flat(seeded_model())).max() > 1e-2


@pytest.mark.parametrize(
    "compressor,options",
    [
        ("dgc", {"density": 0.1, "warmup_steps": 0}),
        ("onebit", {}),
        ("powersgd", {"rank": 1}),
        ("fp16", {}),
        ("randomk", {"density": 0.3}),
    ],
)
def test_every_compressor_gives_the_same_update_through_the_server_as_allreduce(
    pool4, compressor, options
) -> None:
    momentum = 0.0 if compressor == "dgc" else 0.9  # DGC applies momentum itself
    base = Run(compressor=compressor, options=options, momentum=momentum, servers=2)
    through_server = pool4.run(train, base)
    allreduced = pool4.run(
        train, Run(front_end="allreduce", compressor=compressor, options=options, momentum=momentum)
    )
    for ps_result, ar_result in zip(through_server, allreduced, strict=True):
        # fp16 sums round at every addition, in a different order from gloo's: allow that
        atol = 5e-4 if compressor == "fp16" else 1e-5
        np.testing.assert_allclose(ps_result["weights"], ar_result["weights"], rtol=1e-4, atol=atol)
    assert np.abs(allreduced[0]["weights"] - _flat(seeded_model())).max() > 1e-3


@pytest.mark.parametrize("compressor", ["terngrad", "qsgd"])
def test_stochastic_compressors_keep_synchronous_workers_identical_and_learning(
    pool2, compressor
) -> None:
    # their random draws follow the order tensors are compressed in (shard order here,
    # bucket order under all-reduce), so the update is another draw, not the same bits
    steps = 30
    results = pool2.run(train, Run(compressor=compressor, steps=steps, momentum=0.0))
    np.testing.assert_array_equal(results[0]["weights"], results[1]["weights"])
    start, dense = _loss(_flat(seeded_model()), steps), _loss(_reference(2, steps, 0.0), steps)
    assert _loss(results[0]["weights"], steps) < start - 0.5 * (start - dense)


def _loss(weights: np.ndarray, steps: int) -> float:
    """Mean squared error of a model with ``weights`` over both workers' batches."""
    model = seeded_model()
    torch.nn.utils.vector_to_parameters(torch.from_numpy(weights), model.parameters())
    with torch.no_grad():
        losses = [
            nn.functional.mse_loss(model(x), y)
            for x, y in (worker_batch(w, s) for w in (0, 1) for s in range(steps))
        ]
    return float(torch.stack(losses).mean())


@pytest.mark.parametrize("staleness", [0, 2])
def test_asynchronous_server_never_lets_a_worker_run_further_ahead_than_the_bound(
    pool4, staleness
) -> None:
    run = Run(mode="async", staleness=staleness, slow_rank_sleep=0.05, steps=12, servers=2)
    results = pool4.run(train, run)
    servers = [r for r in results if "released" in r]
    assert len(servers) == 2
    for server in servers:
        released, applied = server["released"], server["applied"]
        assert len(applied) == 4 * 12  # every push applied once, on its own
        ahead = [r.next_step - r.slowest for r in released]
        assert max(ahead) <= staleness, ahead
        # the fast workers really did run ahead when the bound allowed it
        if staleness:
            assert max(ahead) == staleness
            assert max(a.staleness for a in applied) > 0
    # stale pushes did not blow the weights up
    weights = np.stack([r["weights"] for r in results])
    assert np.isfinite(weights).all()


def _train_with_short_logs(rank: int, world: int, run: Run) -> dict[str, Any]:
    import thinwire.data_parallel.parameter_server.server

    thinwire.data_parallel.parameter_server.server.LOG_LENGTH = 5  # this worker process only
    return train(rank, world, run)


def test_the_servers_logs_keep_only_the_latest_entries(pool2) -> None:
    """A long job's logs must not grow without bound: 2 workers x 8 pushes, 5 kept, the
    newest ones."""
    results = pool2.run(_train_with_short_logs, Run(mode="async", staleness=8, steps=8))
    (server,) = [r for r in results if "applied" in r]
    applied, released = server["applied"], server["released"]
    assert len(applied) == len(released) == 5
    assert [a.applied_at for a in applied] == list(range(12, 17))  # versions 12..16 of 16
    assert sorted(r.next_step for r in released)[-1] == 8


def test_asynchronous_pushes_are_each_applied_as_one_scaled_sgd_step(pool2) -> None:
    # staleness 0 with equal speeds: still one optimizer step per push, gradient / workers
    results = pool2.run(train, Run(mode="async", staleness=0, momentum=0.0, steps=1))
    # after one step each, both pushes were applied one after the other from w0, each with
    # lr * g_i / 2: plain SGD makes that the same as one step on the mean
    expected = _reference(2, 1, momentum=0.0)
    np.testing.assert_allclose(results[1]["weights"], expected, rtol=1e-5, atol=1e-6)


# -- checkpoints ------------------------------------------------------------------------------


def _steps(ps: thinwire.ParameterServer, model: nn.Module, steps: range) -> None:
    for step in steps:
        x, y = worker_batch(ps.worker_index, step)
        ps.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        ps.step()


def checkpoint_and_resume(rank: int, world: int, run: Run) -> dict[str, Any]:
    """Three steps, a checkpoint, three more, in one job; then a second server, loaded
    from the checkpoint, takes the same three steps."""
    model = seeded_model()
    ps = build_server(model, run, world)
    _steps(ps, model, range(3))
    checkpoint = copy.deepcopy({"ps": ps.state_dict(), "model": model.state_dict()})
    at_checkpoint = _flat(model)
    _steps(ps, model, range(3, 6))
    ps.close()
    resumed_model = seeded_model()
    resumed = build_server(resumed_model, run, world)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["ps"])
    _steps(resumed, resumed_model, range(3, 6))
    resumed.close()
    try:  # refused at once (it used to wait out the whole timeout for closed shards)
        resumed.step()
        after_close = "no error"
    except RuntimeError as error:
        after_close = str(error)
    out: dict[str, Any] = {
        "after_close": after_close,
        "at_checkpoint": at_checkpoint,
        "straight": _flat(model),
        "resumed": _flat(resumed_model),
    }
    if resumed.server is not None:
        out["snapshot_version"] = checkpoint["ps"]["server"]["version"]
        out["applied"] = list(resumed.server.applied)
        out["released"] = list(resumed.server.released)
    another = build_server(seeded_model(), run, world)
    try:  # another rank's part is refused
        another.load_state_dict({**checkpoint["ps"], "rank": {"rank": -1}})
        out["refusal"] = "none"
    except ValueError as error:
        out["refusal"] = str(error)
    another.close()
    return out


@pytest.mark.parametrize(
    ("compressor", "options"),
    [("none", {}), ("powersgd", {"rank": 1}), ("topk", {"density": 0.3})],
)
def test_a_synchronous_checkpoint_resumes_exactly(pool, compressor: str, options: dict) -> None:
    """Momentum on the shards, error feedback and PowerSGD's warm start on the workers,
    and PowerSGD's state on the shards all travel in the checkpoint: the resumed job ends
    on the same weights, bit for bit."""
    run = Run(servers=2, compressor=compressor, options=options)
    results = pool.run(checkpoint_and_resume, run)
    for result in results:
        np.testing.assert_array_equal(result["resumed"], result["straight"])
        assert np.abs(result["straight"] - result["at_checkpoint"]).max() > 1e-3
        assert "step() after close()" in result["after_close"], result["after_close"]


def test_an_asynchronous_checkpoint_is_a_barrier_and_resumes_the_clocks(pool4) -> None:
    """Every worker leaves the checkpoint with the saved weights; the resumed job numbers
    its steps from there and applies every push on top of the saved version."""
    run = Run(mode="async", staleness=1, servers=2)
    results = pool4.run(checkpoint_and_resume, run)
    for result in results[1:]:
        np.testing.assert_array_equal(result["at_checkpoint"], results[0]["at_checkpoint"])
    for server in (r for r in results if "applied" in r):
        applied = server["applied"]
        assert sorted(a.step for a in applied) == sorted(list(range(3, 6)) * 4)
        assert [a.applied_at for a in applied] == [
            server["snapshot_version"] + i + 1 for i in range(len(applied))
        ]
        assert np.isfinite(server["resumed"]).all()
        # the clocks went on from step 3: the first push (step 3) is answered while the
        # others are still at 3 (with clocks from 0 it would wait until all had pushed)
        first = server["released"][0]
        assert (first.next_step, first.slowest) == (4, 3)
    for result in results:
        assert "load each rank's own state_dict()" in result["refusal"]


def _dedicated_checkpoint(rank: int, world: int) -> str:
    model = seeded_model()
    ps = build_server(model, Run(colocated=False), world)
    try:
        ps.state_dict()
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    ps.close()
    return message


def test_a_checkpoint_with_dedicated_servers_is_refused_with_what_to_do(pool2) -> None:
    for message in pool2.run(_dedicated_checkpoint):
        assert "needs colocated servers" in message and "colocated=True" in message


def _warmup_from_zero(rank: int, world: int, front_end: str) -> np.ndarray:
    """A scheduler built before the front end has already set the rate to 0 (a linear
    warm-up); the server takes the schedule's base rate, initial_lr."""
    model = seeded_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: min(1.0, step / 2))
    if front_end == "ps":
        opt: Any = thinwire.ParameterServer(sgd, model)
    else:
        opt = thinwire.DistributedOptimizer(sgd, model)
    for step in range(4):
        x, y = worker_batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        schedule.step()
    if front_end == "ps":
        opt.close()
    return _flat(model)


def test_a_schedule_that_starts_at_zero_is_followed_by_the_server(pool2) -> None:
    """It once divided by the rate at construction (ZeroDivisionError at the first step)."""
    served = pool2.run(_warmup_from_zero, "ps")
    reduced = pool2.run(_warmup_from_zero, "allreduce")
    for a, b in zip(served, reduced, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert np.abs(served[0] - _flat(seeded_model())).max() > 1e-3


def _train_in(rank: int, world: int, dtype: str) -> list[bool]:
    model = seeded_model().to(getattr(torch, dtype))
    ps = build_server(model, Run(), world)
    for step in range(2):
        x, y = worker_batch(ps.worker_index, step)
        ps.zero_grad()
        own = model[0].weight.dtype  # inputs and targets both in the worker's dtype
        nn.functional.mse_loss(model(x.to(own)), y.to(own)).backward()
        ps.step()
    held = [p.detach().clone() for p in ps.server.params] if ps.server is not None else []
    ps.close()
    pulled = [p.detach() for p in model.parameters()]
    checks = [all(p.dtype == getattr(torch, dtype) for p in pulled)]
    if held:  # rank 0 serves the one shard: the workers pulled its weights exactly
        checks.append(all(torch.equal(a, b) for a, b in zip(held, pulled, strict=True)))
    return checks


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_workers_pull_the_weights_in_their_own_dtype(pool2, dtype: str) -> None:
    """fp64 weights came back rounded to fp32 at every pull (the workers computed on and
    saved other weights than the server's)."""
    for checks in pool2.run(_train_in, dtype):
        assert all(checks), checks
