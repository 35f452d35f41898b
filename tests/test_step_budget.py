"""``thinwire bench --step-budget``: slow plans run fewer steps (thinwire.bench.step_budget)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch.distributed as dist

from thinwire.bench import hybrid_sleep
from thinwire.bench.hybrid import HybridConfig
from thinwire.bench.step_budget import StepCount, steps_within
from thinwire.parallel.plan_spec import parse_plan

pytestmark = pytest.mark.timeout(120)

TINY = {"dim": 32, "layers": 2, "heads": 4, "seq_len": 16, "batch_size": 8, "vocab": 256,
        "max_bytes": 200_000, "eval_tokens": 512}  # fmt: skip


def test_a_plan_within_its_budget_or_without_one_runs_every_step() -> None:
    assert steps_within(30.0, 8, 3, 240.0) == StepCount(8, 3)  # 8 x 30 s = 240 s: fits
    assert steps_within(500.0, 8, 3, None) == StepCount(8, 3)
    assert not steps_within(30.0, 8, 3, 240.0).shortened


def test_a_plan_over_its_budget_warms_up_twice_and_times_what_fits() -> None:
    # 100 s a step: two to warm up fill the budget, but two are timed at the least
    assert steps_within(100.0, 8, 3, 240.0) == StepCount(4, 2, shortened=True)
    # 40 s a step: two to warm up, then four in the 160 s left
    assert steps_within(40.0, 8, 3, 240.0) == StepCount(6, 2, shortened=True)
    # 25 s: eight would fit after the warm-up, but no more are timed than were asked for (5)
    assert steps_within(25.0, 8, 3, 180.0) == StepCount(7, 2, shortened=True)
    # asked for one warm-up step, or none: no more are added
    assert steps_within(100.0, 8, 1, 240.0) == StepCount(3, 1, shortened=True)
    assert steps_within(100.0, 5, 0, 150.0) == StepCount(2, 0, shortened=True)


def test_nothing_is_cut_from_a_plan_already_at_the_least() -> None:
    for steps, untimed in ((4, 2), (3, 1)):
        count = steps_within(1000.0, steps, untimed, 1.0)
        assert count == StepCount(steps, untimed) and not count.shortened


@pytest.mark.parametrize("budget", [0, -5.0, math.inf, math.nan, True, "240"])
def test_a_budget_must_be_positive_finite_seconds(budget) -> None:
    with pytest.raises(ValueError, match="--step-budget must be"):
        steps_within(1.0, 8, 3, budget)
    with pytest.raises(ValueError, match="--step-budget must be"):
        HybridConfig(
            task="gpt", plans=(parse_plan("2x1x1"),), steps=8, compute="sleep",
            step_budget_s=budget,
        )  # fmt: skip


def test_a_budget_needs_sleeping_compute_and_a_real_step_time() -> None:
    with pytest.raises(ValueError, match="add --compute sleep"):
        HybridConfig(task="gpt", plans=(parse_plan("2x1x1"),), steps=8, step_budget_s=60.0)
    with pytest.raises(ValueError, match="a step cannot take"):
        steps_within(-1.0, 8, 3, 60.0)
    with pytest.raises(ValueError, match="4 steps leave none to time after 4 untimed"):
        steps_within(1.0, 4, 4, 60.0)


def test_a_plan_asked_for_one_timed_step_keeps_it_and_loses_a_warm_up_step() -> None:
    assert steps_within(100.0, 4, 3, 120.0) == StepCount(3, 2, shortened=True)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_timed_plan_over_its_budget_runs_fewer_steps_and_skips_the_exchange_alone(
    one_rank, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("THINWIRE_CACHE", str(tmp_path))
    alone = []
    monkeypatch.setattr(
        hybrid_sleep, "exchange_alone", lambda trainer, phases: alone.append(1) or {}
    )
    plan = parse_plan("1x1x1/mb2")

    def timed(budget: float | None) -> dict:
        config = HybridConfig(
            task="gpt", plans=(plan,), steps=6, untimed_steps=3, compute="sleep",
            task_options=TINY, step_budget_s=budget,
        )  # fmt: skip
        profiles = hybrid_sleep.profile(config, plan)
        return hybrid_sleep.time_plan(0, 1, config, plan, profiles)

    asked = timed(None)
    assert len(asked["steps_s"]) == 6 and asked["untimed_steps"] == 3
    assert asked["step_s"] == statistics.median(asked["steps_s"][3:])
    assert alone == [1]  # timed alone once, as without a budget
    cut = timed(1e-6)  # any step overruns it: two to warm up, two timed
    assert len(cut["steps_s"]) == 4 and cut["untimed_steps"] == 2
    assert cut["step_s"] == statistics.median(cut["steps_s"][2:])
    assert cut["exchange_alone_s"] == {} and alone == [1]  # not run again
    # the count follows rank 0's first step as every rank receives it, not its own
    monkeypatch.setattr(hybrid_sleep, "agreed_seconds", lambda seconds: 0.0)
    assert len(timed(1e-6)["steps_s"]) == 6  # rank 0 said its step took no time
    monkeypatch.setattr(hybrid_sleep, "agreed_seconds", lambda seconds: 50.0)
    assert len(timed(100.0)["steps_s"]) == 4  # 6 x 50 s: over, though this one was fast


def test_the_command_line_passes_the_budget_and_refuses_a_bad_one(capsys) -> None:
    from thinwire.cli import main

    sweep = ["bench", "--task", "gpt", "--plans", "2x1x1", "--steps", "8"]
    assert main([*sweep, "--compute", "sleep", "--step-budget", "0"]) == 2
    assert "--step-budget must be > 0 s" in capsys.readouterr().out
    assert main([*sweep, "--step-budget", "60"]) == 2  # real compute: refused, not ignored
    assert "add --compute sleep" in capsys.readouterr().out
