"""The parameter server: bad setups are refused; a lost server or worker is an error, not a hang."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import thinwire
from ps_cases import Run, build_server, seeded_model, worker_batch
from thinwire.data_parallel.parameter_server.channels import LocalPair
from thinwire.data_parallel.parameter_server.sharding import assign_shards
from thinwire.launch import init_local_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


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
    model = seeded_model()
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
    model = seeded_model()
    saved = thinwire.ParameterServer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, "topk", density=0.5
    )
    for step in range(2):
        x, y = worker_batch(rank, step)
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
    model = seeded_model()
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
    model = seeded_model()
    ps = thinwire.ParameterServer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    x, y = worker_batch(rank, 0)
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
    model = seeded_model()
    ps = thinwire.ParameterServer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, colocated=False, servers=1
    )
    doomed = 0 if who == "server" else 1
    if rank == doomed:
        if ps.is_worker:
            for step in range(2):
                x, y = worker_batch(0, step)
                nn.functional.mse_loss(model(x), y).backward()
                ps.step()
        os._exit(0)  # vanishes without a word, as a killed process would
    try:
        if ps.is_server:
            ps.serve()
        else:
            for step in range(20):
                x, y = worker_batch(0, step)
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
    model = seeded_model()
    ps = thinwire.ParameterServer(torch.optim.SGD(model.parameters(), lr=0.1), model, timeout_s=3)
    for step in range(2):
        x, y = worker_batch(rank, step)
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


def _serve_on_a_worker(rank: int, world: int) -> str:
    ps = build_server(seeded_model(), Run(colocated=False), world)
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
