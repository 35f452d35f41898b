"""The parameter server: synchronous mode is all-reduce SGD, asynchronous mode keeps its
staleness bound, every compressor goes through it, and a lost server or worker gives a
clear error instead of a hang."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import thinwire
from thinwire.data_parallel.parameter_server.channels import LocalPair
from thinwire.data_parallel.parameter_server.sharding import assign_shards
from thinwire.launch import init_local_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STEPS = 6
BATCH = 5


@dataclass(frozen=True)
class Run:
    """One training run: how the ranks exchange, with which compressor and optimizer."""

    front_end: str = "ps"  # or "allreduce": thinwire.DistributedOptimizer
    mode: str = "sync"
    servers: int = 1
    colocated: bool = True
    compressor: str = "none"
    options: dict = field(default_factory=dict)
    momentum: float = 0.9
    staleness: int = 1
    slow_rank_sleep: float = 0.0
    steps: int = STEPS


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator)


def _flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def train(rank: int, world: int, run: Run) -> dict[str, Any]:
    """Train ``run.steps`` steps of SGD on this rank's batches; return the final weights
    (as pulled, or after the all-reduce step) and, on a server rank, its logs."""
    model = _model()
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
            x, y = _batch(worker, step)
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
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for step in range(steps):
        sgd.zero_grad()
        for worker in range(workers):
            x, y = _batch(worker, step)
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
    assert np.abs(expected - _flat(_model())).max() > 1e-2


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
    assert np.abs(allreduced[0]["weights"] - _flat(_model())).max() > 1e-3


@pytest.mark.parametrize("compressor", ["terngrad", "qsgd"])
def test_stochastic_compressors_keep_synchronous_workers_identical_and_learning(
    pool2, compressor
) -> None:
    # their random draws follow the order tensors are compressed in (shard order here,
    # bucket order under all-reduce), so the update is another draw, not the same bits
    steps = 30
    results = pool2.run(train, Run(compressor=compressor, steps=steps, momentum=0.0))
    np.testing.assert_array_equal(results[0]["weights"], results[1]["weights"])
    start, dense = _loss(_flat(_model()), steps), _loss(_reference(2, steps, 0.0), steps)
    assert _loss(results[0]["weights"], steps) < start - 0.5 * (start - dense)


def _loss(weights: np.ndarray, steps: int) -> float:
    """Mean squared error of a model with ``weights`` over both workers' batches."""
    model = _model()
    torch.nn.utils.vector_to_parameters(torch.from_numpy(weights), model.parameters())
    with torch.no_grad():
        losses = [
            nn.functional.mse_loss(model(x), y)
            for x, y in (_batch(w, s) for w in (0, 1) for s in range(steps))
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


def _server(model: nn.Module, run: Run, world: int) -> thinwire.ParameterServer:
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=run.momentum)
    return thinwire.ParameterServer(
        sgd,
        model,
        run.compressor,
        mode=run.mode,
        servers=min(run.servers, world),
        colocated=run.colocated,
        staleness=run.staleness,
        **run.options,
    )


def _steps(ps: thinwire.ParameterServer, model: nn.Module, steps: range) -> None:
    for step in steps:
        x, y = _batch(ps.worker_index, step)
        ps.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        ps.step()


def checkpoint_and_resume(rank: int, world: int, run: Run) -> dict[str, Any]:
    """Three steps, a checkpoint, three more, in one job; then a second server, loaded
    from the checkpoint, takes the same three steps."""
    model = _model()
    ps = _server(model, run, world)
    _steps(ps, model, range(3))
    checkpoint = copy.deepcopy({"ps": ps.state_dict(), "model": model.state_dict()})
    at_checkpoint = _flat(model)
    _steps(ps, model, range(3, 6))
    ps.close()
    resumed_model = _model()
    resumed = _server(resumed_model, run, world)
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
    another = _server(_model(), run, world)
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
    model = _model()
    ps = _server(model, Run(colocated=False), world)
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


def test_shards_are_balanced_and_deterministic() -> None:
    params = [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate([100, 10, 60, 50, 5])]
    shards = assign_shards(params, 2)
    assert sorted(i for shard in shards for i in shard) == list(range(5))
    sizes = [sum(params[i][1].numel() for i in shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 10
    assert shards == assign_shards(params, 2)
    with pytest.raises(ValueError, match="a shard would be empty"):
        assign_shards(params, 6)


def test_bad_options_are_refused_before_anything_is_sent(pool2) -> None:
    messages = pool2.run(_bad_options)
    for message in messages:
        assert "mode must be one of" in message[0]
        assert "staleness must be an integer >= 0" in message[1]
        assert "leaves no worker" in message[2]
        assert all("timeout_s must be a number of seconds > 0" in m for m in message[3:6])
        assert "which is 0.0: build the optimizer with its peak rate" in message[6]


def _bad_options(rank: int, world: int) -> list[str]:
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    messages = []
    for kwargs in (
        {"mode": "eventual"},
        {"staleness": -1},
        {"servers": 2, "colocated": False},
        {"timeout_s": -1},
        {"timeout_s": "5"},
        {"timeout_s": float("nan")},
    ):
        try:
            thinwire.ParameterServer(sgd, model, **kwargs)
        except ValueError as error:
            messages.append(str(error))
    try:
        thinwire.ParameterServer(torch.optim.SGD(model.parameters(), lr=0.0), model)
    except ValueError as error:
        messages.append(str(error))
    return messages


def _load_another_compressors_state(rank: int, world: int) -> list[str]:
    """A checkpoint of a top-k server loaded into a PowerSGD one: refused before anything
    changed, so the same call fails the same way again (it once set the step first, and
    the retry then said the rank had stepped)."""
    model = _model()
    saved = thinwire.ParameterServer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, "topk", density=0.5
    )
    for step in range(2):
        x, y = _batch(rank, step)
        saved.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        saved.step()
    state = saved.state_dict()
    saved.close()
    other = thinwire.ParameterServer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, "powersgd", rank=1
    )
    messages = []
    for _ in range(2):
        try:
            other.load_state_dict(state)
        except (ValueError, RuntimeError) as error:
            messages.append(f"{type(error).__name__}: {error}")
    messages.append(str(other.versions))
    other.close()
    return messages


def test_another_compressors_checkpoint_is_refused_before_anything_changes(pool2) -> None:
    for first, again, versions in pool2.run(_load_another_compressors_state):
        assert first.startswith("ValueError") and "saved with compressor TopK" in first
        assert again == first
        assert versions == "[0]"


def _double_on_rank_one(rank: int, world: int) -> str:
    model = _model()
    if rank == 1:
        model = model.double()
    try:
        thinwire.ParameterServer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    except thinwire.RankMismatchError as error:
        return str(error)
    return "no error"


def test_parameter_dtypes_must_agree_across_ranks(pool2) -> None:
    """Rank 0's fp32 weights are broadcast into every rank: into fp64 they were garbage."""
    for message in pool2.run(_double_on_rank_one):
        assert "has different parameters (names, shapes or dtypes)" in message, message


def _warmup_from_zero(rank: int, world: int, front_end: str) -> np.ndarray:
    """A scheduler built before the front end has already set the rate to 0 (a linear
    warm-up); the server takes the schedule's base rate, initial_lr."""
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: min(1.0, step / 2))
    if front_end == "ps":
        opt: Any = thinwire.ParameterServer(sgd, model)
    else:
        opt = thinwire.DistributedOptimizer(sgd, model)
    for step in range(4):
        x, y = _batch(rank, step)
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
    assert np.abs(served[0] - _flat(_model())).max() > 1e-3


def test_an_in_process_answer_sent_before_a_failure_is_still_delivered() -> None:
    # The colocated server answers "poisoned", then its thread fails; the worker waiting
    # on it must read the answer (and raise NonFiniteGradientError), not the failure.
    pair = LocalPair(timeout=5.0)
    pair.server_end.send(torch.tensor([7.0], dtype=torch.float64)).wait()
    pair.failure = RuntimeError("server thread stopped")
    answer = torch.empty(1, dtype=torch.float64)
    pair.worker_end.recv(answer).wait()
    assert float(answer[0]) == 7.0
    with pytest.raises(thinwire.CommunicationError, match="server thread stopped"):
        pair.worker_end.recv(answer).wait()


def test_a_non_finite_gradient_stops_every_worker_with_a_clear_error(pool2) -> None:
    for outcome in pool2.run(_push_nan):
        assert outcome.startswith("NonFiniteGradientError"), outcome
        assert "non-finite gradient" in outcome and "applied nothing" in outcome


def _push_nan(rank: int, world: int) -> str:
    model = _model()
    ps = thinwire.ParameterServer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    x, y = _batch(rank, 0)
    if rank == 1:
        x[0, 0] = float("nan")
    nn.functional.mse_loss(model(x), y).backward()
    try:
        ps.step()
    except thinwire.NonFiniteGradientError as error:
        return f"NonFiniteGradientError: {error}"
    return "no error"


# -- a server or a worker that dies: the others get an error, not a hang --------------------


def _lost_peer(rank: int, port: int, who: str, results: mp.Queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    init_local_group(rank, 2, port, timeout_s=4)
    model = _model()
    ps = thinwire.ParameterServer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, colocated=False, servers=1
    )
    doomed = 0 if who == "server" else 1
    if rank == doomed:
        if ps.is_worker:
            for step in range(2):
                x, y = _batch(0, step)
                nn.functional.mse_loss(model(x), y).backward()
                ps.step()
        os._exit(0)  # vanishes without a word, as a killed process would
    try:
        if ps.is_server:
            ps.serve()
        else:
            for step in range(20):
                x, y = _batch(0, step)
                nn.functional.mse_loss(model(x), y).backward()
                ps.step()
    except thinwire.CommunicationError as error:
        results.put(("error", rank, str(error)))
        return
    results.put(("finished", rank, ""))
    dist.destroy_process_group()


def _a_worker_never_closes(rank: int, port: int, results: mp.Queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    init_local_group(rank, 2, port, timeout_s=30)
    model = _model()
    ps = thinwire.ParameterServer(torch.optim.SGD(model.parameters(), lr=0.1), model, timeout_s=3)
    for step in range(2):
        x, y = _batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        ps.step()
    if rank == 1:
        time.sleep(60)  # alive, but never closes
        return
    try:
        ps.close()
    except thinwire.CommunicationError as error:
        results.put(("error", rank, str(error)))
        return
    results.put(("closed", rank, ""))


def test_close_with_a_worker_that_never_closes_is_an_error(
    first_report: Callable[..., Any],
) -> None:
    """close() on the server's rank used to return as if all was well after the timeout,
    its shard still waiting."""
    began = time.monotonic()
    kind, rank, message = first_report(_a_worker_never_closes, timeout=60)
    assert (kind, rank) == ("error", 0), message
    assert "call close() on every rank" in message or "stalled" in message, message
    assert time.monotonic() - began < 40


@pytest.mark.parametrize("who", ["server", "worker"])
def test_losing_a_server_or_a_worker_gives_a_communication_error(
    who: str, first_report: Callable[..., Any]
) -> None:
    began = time.monotonic()
    kind, rank, message = first_report(_lost_peer, who, timeout=60)
    assert kind == "error", message
    assert rank == (1 if who == "server" else 0)
    assert "has probably died or stalled" in message
    assert time.monotonic() - began < 40


def _train_in(rank: int, world: int, dtype: str) -> list[bool]:
    model = _model().to(getattr(torch, dtype))
    ps = _server(model, Run(), world)
    for step in range(2):
        x, y = _batch(ps.worker_index, step)
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


def _serve_on_a_worker(rank: int, world: int) -> str:
    ps = _server(_model(), Run(colocated=False), world)
    message = "server rank"
    if ps.is_worker:
        try:
            ps.serve()
            message = "no error"
        except RuntimeError as error:
            message = str(error)
    ps.close()
    return message


def test_serve_on_a_worker_says_which_ranks_serve(pool2) -> None:
    """It said serve() was for colocated=False, which the user had passed."""
    _, worker = pool2.run(_serve_on_a_worker)
    assert "rank 1 is a worker (the servers are ranks 0 .. 0)" in worker, worker
