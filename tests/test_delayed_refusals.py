"""Delayed Gradient Averaging: refused setups, checkpoints after flush, NaNs and dead peers."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import thinwire
from delayed_cases import flat, seeded_model
from thinwire.data_parallel.replay import ConsensusReplay
from thinwire.launch import init_local_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


# -- checkpoints, options, agreement on the configuration ------------------------------------


def _switch_momentum_off(rank: int, world: int) -> str:
    model = seeded_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = thinwire.DelayedAveraging(sgd, model, delay=1)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    sgd.param_groups[0]["momentum"] = 0.0
    try:
        opt.step()
    except ValueError as error:
        return str(error)
    finally:
        opt.flush()
    return "no error"


def test_switching_momentum_off_is_refused_with_what_to_do(pool2) -> None:
    for message in pool2.run(_switch_momentum_off):
        assert "momentum is 0 now but was 0.9" in message and "not switch it on or off" in message


def test_lanes_are_refused_for_compressors_with_state(pool2) -> None:
    for message in pool2.run(_lanes_with_topk):
        assert "carries state from one step to the next" in message
        assert "use lanes=1" in message


def _lanes_with_topk(rank: int, world: int) -> str:
    model = seeded_model()
    try:
        thinwire.DelayedAveraging(
            torch.optim.SGD(model.parameters(), lr=0.1), model, "topk", delay=2, lanes=2
        )
    except ValueError as error:
        return str(error)
    return "accepted"


def checkpoint_after_flush(rank: int, world: int) -> tuple[str, int, list[str]]:
    model = seeded_model()
    opt = thinwire.DelayedAveraging(torch.optim.SGD(model.parameters(), lr=0.1), model, delay=2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
    try:
        opt.state_dict()
        refusal = "no error"
    except RuntimeError as error:
        refusal = str(error)
    opt.flush()
    state = opt.state_dict()
    sync = thinwire.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    sync.load_state_dict(state)  # a flushed checkpoint is a DistributedOptimizer's
    return refusal, sync.engine.step, sorted(state)


def _adam(state: dict | None = None) -> tuple[nn.Module, thinwire.DelayedAveraging]:
    """Adam under DelayedAveraging (delay 2), loaded from ``state`` after construction as a
    resumed job does (model, then optimizer)."""
    model = seeded_model()
    opt = thinwire.DelayedAveraging(torch.optim.Adam(model.parameters(), lr=0.01), model, delay=2)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    return model, opt


def _adam_steps(rank: int, model: nn.Module, opt: thinwire.DelayedAveraging, steps: range) -> None:
    for step in steps:
        data = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        model(torch.randn(4, 6, generator=data)).pow(2).sum().backward()
        opt.step()
    opt.flush()


def resumed_adam(rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Three steps, a flush, three more, in one job; and the last three in a new job loaded
    from the checkpoint taken at the flush."""
    model, opt = _adam()
    _adam_steps(rank, model, opt, range(3))
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    _adam_steps(rank, model, opt, range(3, 6))
    resumed_model, resumed_opt = _adam(checkpoint)
    _adam_steps(rank, resumed_model, resumed_opt, range(3, 6))
    return flat(model.parameters()), flat(resumed_model.parameters())


def test_replayed_optimizer_resumes_from_a_flushed_checkpoint(pool2) -> None:
    """After loading, the consensus adopts the loaded weights and Adam's moments."""
    finals = pool2.run(resumed_adam)
    for straight, resumed in finals:
        np.testing.assert_array_equal(resumed, straight)
        np.testing.assert_array_equal(resumed, finals[0][1])


def test_state_dict_is_refused_until_flush(pool2) -> None:
    for refusal, step, keys in pool2.run(checkpoint_after_flush):
        assert "2 step(s) of corrections pending (delay=2)" in refusal and "flush()" in refusal
        assert step == 3 and keys == ["optimizer", "thinwire"]


def different_delays(rank: int, world: int, first: int) -> str:
    model = seeded_model()
    try:
        thinwire.DelayedAveraging(
            torch.optim.SGD(model.parameters(), lr=0.1), model, delay=first + rank
        )
    except thinwire.RankMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("first", [0, 1])
def test_ranks_with_different_delays_are_refused(pool2, first: int) -> None:
    """Delay 0 against 1 is refused too (not a hang in the exchange's setup)."""
    messages = pool2.run(different_delays, first)
    assert f"delay={first}" in messages[0] and f"delay={first + 1}" in messages[1]
    for message in messages:
        assert f"range from {first} to {first + 1}" in message


def different_lanes_or_optimizers(rank: int, world: int, what: str) -> str:
    model = seeded_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    if what == "optimizer" and rank == 1:
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    elif what == "momentum" and rank == 1:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = sgd
    lanes = 1 + rank if what == "lanes" else 1
    try:
        thinwire.DelayedAveraging(optimizer, model, delay=2, lanes=lanes)
    except thinwire.RankMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("what", ["lanes", "optimizer", "momentum"])
def test_ranks_with_different_lanes_or_optimizers_are_refused(pool2, what: str) -> None:
    """Found only at the timeout (lanes), or never: SGD on one rank and Adam on the other
    trained on, and the ranks ended 0.24 apart."""
    for message in pool2.run(different_lanes_or_optimizers, what):
        if what == "lanes":
            assert "lanes=" in message and "range from 1 to 2" in message, message
        else:
            assert "optimizers differ in class or settings" in message, message


@pytest.mark.parametrize("delay", [-1, 1.5, True, "2", None])
def test_bad_delay_is_refused_naming_the_value(delay) -> None:
    model = seeded_model()
    with pytest.raises(
        ValueError, match=r"delay must be an integer >= 0.*got " + re.escape(repr(delay))
    ):
        thinwire.DelayedAveraging(torch.optim.SGD(model.parameters(), lr=0.1), model, delay=delay)


def test_bad_bucket_cap_is_refused_naming_the_value() -> None:
    model = seeded_model()
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be a number > 0, got 0"):
        thinwire.DelayedAveraging(
            torch.optim.SGD(model.parameters(), lr=0.1), model, delay=1, bucket_cap_mb=0
        )


# -- a peer that dies: the survivor's error surfaces when the exchange is waited for --------


def _survivor_or_casualty(rank: int, port: int, fate: str, results: mp.Queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    init_local_group(rank, 2, port, timeout_s=4)
    model = seeded_model()
    opt = thinwire.DelayedAveraging(torch.optim.SGD(model.parameters(), lr=0.1), model, delay=2)
    for step in range(20):
        if rank == 1 and step == 3:
            if fate == "stalls":
                time.sleep(30)  # alive but silent: only the timeout can tell
            os._exit(0)  # dies without a word, as a killed process would
        opt.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        try:
            opt.step()
        except thinwire.CommunicationError as error:
            results.put(("error", step, str(error)))
            return
    results.put(("finished", 20, ""))


@pytest.mark.parametrize("fate", ["dies", "stalls"])
def test_lost_peer_gives_a_communication_error_not_a_hang(
    fate: str, first_report: Callable[..., Any]
) -> None:
    kind, step, message = first_report(_survivor_or_casualty, fate)
    # Rank 1 vanishes at step 3. A stalled rank finished its exchanges of steps 1 and 2,
    # so step 3's fails, waited for (and raised) at step 5 = 3 + delay; a dead one may
    # take exchanges 1 and 2 down with it, which are waited for at steps 3 and 4.
    assert kind == "error", (kind, step, message)
    assert step == 5 if fate == "stalls" else 3 <= step <= 5, (step, message)
    assert "peer rank has probably died" in message


class _NeedsAScale(torch.optim.SGD):
    """An optimizer whose constructor needs more than its parameter groups."""

    def __init__(self, params, scale: float) -> None:
        super().__init__(params, lr=0.1 * scale)


def test_an_optimizer_that_cannot_be_built_again_is_refused_with_the_reason() -> None:
    model = seeded_model()
    nesterov = _NeedsAScale(model.parameters(), scale=1.0)
    nesterov.param_groups[0].update(momentum=0.9, nesterov=True)  # no closed form: replayed
    with pytest.raises(TypeError, match="second _NeedsAScale over copies of the parameters"):
        ConsensusReplay(nesterov)


def test_the_optimizer_benchmark_finds_ranks_on_one_consensus(tmp_path) -> None:
    """bench/dga_optimizers.py: Adam under a delay ends with every rank on the same
    weights, away from the synchronous run's (it did train differently)."""
    script = Path(__file__).resolve().parents[1] / "bench" / "dga_optimizers.py"
    out = tmp_path / "adam.json"
    argv = ["--workers", "2", "--steps", "30", "--delays", "0,2", "--check-every", "10"]
    done = subprocess.run(
        [sys.executable, str(script), *argv, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    sync, delayed = json.loads(out.read_text())
    assert (sync["delay"], delayed["delay"]) == (0, 2)
    assert [step for step, _ in delayed["spread_after_flush"]] == [10, 20, 30]
    assert all(spread == 0 for _, spread in delayed["spread_after_flush"])
    assert len(set(delayed["accuracy_per_rank"])) == 1
    assert delayed["distance_from_first_run"] > 1e-3


def test_the_replay_cost_script_times_each_delay() -> None:
    script = Path(__file__).resolve().parents[1] / "bench" / "replay_cost.py"
    done = subprocess.run(
        [sys.executable, str(script), "--task", "digits", "--delays", "1,3", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    times = re.findall(r"^(Adam step|replayed step, D = \d): ([\d.]+) ms$", done.stdout, re.M)
    assert [name for name, _ in times] == [
        "Adam step",
        "replayed step, D = 1",
        "replayed step, D = 3",
    ]
    assert all(float(ms) > 0 for _, ms in times)


def nan_on_rank_one_at_step_one(rank: int, world: int) -> dict:
    model = seeded_model()
    opt = thinwire.DelayedAveraging(torch.optim.SGD(model.parameters(), lr=0.1), model, delay=1)
    out: dict = {}
    for step in range(2):
        x = torch.randn(4, 6)
        if rank == 1 and step == 1:
            x[0, 0] = float("nan")
        opt.zero_grad()
        model(x).sum().backward()
        try:
            opt.step()
        except thinwire.NonFiniteGradientError as error:
            out["step"] = str(error)
    out["finite_before_flush"] = all(bool(p.isfinite().all()) for p in model.parameters())
    try:
        opt.flush()
    except thinwire.NonFiniteGradientError as error:
        out["flush"] = str(error)
    return out


def test_a_nan_gradient_is_not_applied_locally_and_every_rank_hears_of_it(pool2) -> None:
    """The rank with the NaN raises at once, before its local step (its weights stay
    finite); every rank's correction of that step then fails, saying the weights no longer
    agree (the message once said no rank applied anything, which was false under a delay)."""
    first, second = pool2.run(nan_on_rank_one_at_step_one)
    assert "step" not in first
    assert "on this rank (1)" in second["step"] and "did not apply it" in second["step"]
    assert first["finite_before_flush"] and second["finite_before_flush"]
    for out in (first, second):
        assert "non-finite gradient" in out["flush"]
        assert "restore every rank from the last checkpoint" in out["flush"]


def large_fp16_gradients(rank: int, world: int) -> str:
    model = nn.Linear(100, 1).half()
    opt = thinwire.DelayedAveraging(torch.optim.SGD(model.parameters(), lr=1e-6), model, delay=1)
    try:
        for _ in range(2):
            for p in model.parameters():  # finite, but their fp16 sum (1e5) is not
                p.grad = torch.full_like(p, 1000.0)
            opt.step()
        opt.flush()
    except thinwire.NonFiniteGradientError as error:
        return str(error)
    return "no error"


def test_finite_gradients_whose_sum_overflows_are_not_refused(pool2) -> None:
    assert pool2.run(large_fp16_gradients) == ["no error", "no error"]


def add_a_group_then_step(rank: int, world: int) -> str:
    model = seeded_model()
    sgd = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    opt = thinwire.DelayedAveraging(sgd, model, delay=1)
    sgd.add_param_group({"params": list(model[2].parameters())})
    model(torch.randn(4, 6)).sum().backward()
    try:
        opt.step()
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_group_added_to_a_closed_form_optimizer_is_refused_too(pool2) -> None:
    """SGD's correction skipped the new group's parameters: ranks drifted apart on them."""
    for message in pool2.run(add_a_group_then_step):
        assert "[2] at construction, [2, 2] now" in message
        assert "build DelayedAveraging after add_param_group()" in message


def test_a_parameter_group_added_after_construction_is_refused_with_what_to_do() -> None:
    model = seeded_model()
    adam = torch.optim.Adam(model[0].parameters())
    replay = ConsensusReplay(adam)
    replay.check_unchanged()
    adam.add_param_group({"params": list(model[2].parameters())})
    with pytest.raises(ValueError, match=r"build DelayedAveraging after add_param_group\(\)"):
        replay.check_unchanged()


def _collectives_between_steps(rank: int, world: int) -> dict:
    """Log the loss with an all-reduce after every step, as training scripts do, while
    the exchanges of the last steps are still in flight (tiny buckets: many collectives)."""
    model = seeded_model()
    opt = thinwire.DelayedAveraging(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        delay=2,
        bucket_cap_mb=1e-5,
        fuse_rounds=False,
    )
    logged, losses = [], []
    for step in range(12):
        data = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(5, 6, generator=data), torch.randn(5, 3, generator=data)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        total = torch.tensor([float(loss)] * 3)  # the shape of the last layer's bias
        torch.distributed.all_reduce(total)
        logged.append(total.tolist())
        losses.append(float(loss))
    opt.flush()
    return {"logged": logged, "losses": losses, "final": flat(model.parameters())}


def test_the_program_s_own_collectives_between_steps_do_not_meet_the_exchanges(pool2) -> None:
    """The exchanges ran on the program's process group from a background thread: a
    logged loss's all-reduce was summed with a bias bucket (17 of 40 sums wrong, the ranks
    0.06 apart after flush), or gloo aborted the process on a size mismatch."""
    first, second = pool2.run(_collectives_between_steps)
    sums = np.add(first["losses"], second["losses"])
    np.testing.assert_allclose(first["logged"], np.repeat(sums[:, None], 3, 1), rtol=1e-6)
    assert first["logged"] == second["logged"]
    np.testing.assert_allclose(first["final"], second["final"], rtol=0, atol=1e-6)
