"""Schedules as programs, and the simulator running them: each micro-batch's forward,
recomputation and backward in order, the shifted schedule recomputing before it waits for
the gradient, and the step times that follow on stages of known costs."""

from __future__ import annotations

import pytest

from thinwire.parallel.schedule_programs import BWD, PROGRAM_SCHEDULES, program
from thinwire.plan.schedule_sim import Message, StageTimes, simulate

pytestmark = pytest.mark.timeout(60)


def computes(actions: list[tuple]) -> list[tuple[str, int]]:
    return [(a[1], a[2]) for a in actions if a[0] == "compute"]


@pytest.mark.parametrize("schedule", PROGRAM_SCHEDULES)
@pytest.mark.parametrize("recompute", [False, True])
def test_every_microbatch_runs_forward_recompute_backward_in_order(schedule, recompute) -> None:
    stages, m = 4, 6
    for stage in range(stages):
        done = computes(program(schedule, stage, stages, m, recompute))
        for i in range(m):
            kinds = [k for k, j in done if j == i]
            assert kinds == (["F", "R", "B"] if recompute else ["F", "B"])
        assert [j for k, j in done if k == "B"] == list(range(m))


def test_1f1b_recomputes_after_the_gradient_arrives_and_shifted_before() -> None:
    for schedule, before in (("1f1b", False), ("shifted-1f1b", True)):
        actions = program(schedule, 1, 4, 6, recompute=True)
        for i in range(6):
            recompute = next(n for n, a in enumerate(actions) if a[:3] == ("compute", "R", i))
            assert (actions[recompute][3:] == ("in-backward",)) != before
            wait = next(n for n, a in enumerate(actions) if a[0] == "wait" and (BWD, 1, i) in a[1])
            assert (recompute < wait) == before, (schedule, i)


def test_without_recomputation_shifted_1f1b_is_1f1b() -> None:
    for stage in range(4):
        assert program("shifted-1f1b", stage, 4, 8) == program("1f1b", stage, 4, 8)
    # the last stage has no gradient to wait for: it recomputes inside its backward
    assert program("shifted-1f1b", 3, 4, 8, True) == program("1f1b", 3, 4, 8, True)


def test_an_unknown_schedule_is_named() -> None:
    with pytest.raises(ValueError, match="no program for schedule 'zb'"):
        program("zb", 0, 2, 2)


def no_wire(stages: int) -> list[Message]:
    return [Message(0.0)] * (stages - 1)


def test_1f1b_with_recomputation_takes_m_plus_p_minus_1_slots_of_f_r_b() -> None:
    # four equal stages, forward 1, backward 2, recomputation 1, a free wire
    times = [StageTimes(1.0, 2.0, 1.0)] * 4
    step = simulate("1f1b", 8, times, no_wire(4), no_wire(4)).step_s
    assert step == pytest.approx((8 + 4 - 1) * 4.0)
    assert simulate("1f1b", 8, [StageTimes(1.0, 2.0)] * 4, no_wire(4), no_wire(4)).step_s == (
        pytest.approx((8 + 4 - 1) * 3.0)
    )


def test_shifting_recomputation_off_the_critical_path_shortens_the_step() -> None:
    uniform = [StageTimes(1.0, 2.0, 1.0)] * 4
    stage_aware = [StageTimes(1.0, 2.0, r) for r in (1.0, 0.5, 0.5, 0.0)]
    step = {
        (name, schedule): simulate(schedule, 8, times, no_wire(4), no_wire(4)).step_s
        for name, times in (("uniform", uniform), ("stage-aware", stage_aware))
        for schedule in ("1f1b", "shifted-1f1b")
    }
    assert step[("uniform", "shifted-1f1b")] < step[("uniform", "1f1b")]
    assert step[("stage-aware", "1f1b")] < step[("uniform", "1f1b")]
    assert step[("stage-aware", "shifted-1f1b")] < step[("stage-aware", "1f1b")]
    # the first stage still recomputes every micro-batch: 8 x (1 + 2 + 1) at least
    assert step[("stage-aware", "shifted-1f1b")] >= 32.0


def test_recomputation_does_not_count_as_a_microbatch_in_flight() -> None:
    times = [StageTimes(1.0, 2.0, 1.0)] * 4
    result = simulate("shifted-1f1b", 8, times, no_wire(4), no_wire(4))
    assert result.peak_in_flight == (4, 3, 2, 1)


def sleeping_stage(recompute: bool):
    """A virtual accelerator over a small stage: forward 10 ms, recomputation 5 ms,
    backward 20 ms (no collectives)."""
    import torch

    from thinwire.bench.sleeping_stages import SleepingStage
    from thinwire.parallel.layout import read_layout
    from thinwire.parallel.stages import StageModule
    from thinwire.plan.stage_profile import Pass, StageProfile
    from thinwire.tasks.transformer import TransformerConfig, TransformerLM

    model = TransformerLM(TransformerConfig(dim=16, layers=2, heads=2, vocab=32, max_seq=8))
    stage = StageModule(model, read_layout(model), range(2), first=False, last=False,
                        recompute=1.0 if recompute else 0.0)  # fmt: skip
    profile = StageProfile(
        index=1, forward=Pass((), 0.01), backward=Pass((), 0.02), output_shape=(2, 8, 16),
        output_dtype="torch.float32", parameter_shapes=(),
        recompute=Pass((), 0.005) if recompute else None,
    )  # fmt: skip
    sleeper = SleepingStage(stage, profile, {}, None)
    return stage, sleeper, torch


def test_a_virtual_accelerator_recomputes_in_the_backward_or_when_asked() -> None:
    stage, sleeper, torch = sleeping_stage(recompute=True)
    x = torch.zeros(2, 8, 16, requires_grad=True)
    stage(x).sum().backward()  # recomputes inside the backward
    assert [kind for kind, *_ in sleeper.events] == ["F", "R", "B"]
    sleeper.events.clear()
    out = stage(x)
    assert stage.recompute_next()  # a schedule's recompute action, before the gradient
    out.sum().backward()  # does not recompute again
    assert [kind for kind, *_ in sleeper.events] == ["F", "R", "B"]
    seconds = {kind: end - start for kind, start, end in sleeper.events}
    assert seconds["R"] >= 0.005 and seconds["B"] >= 0.02 and seconds["F"] >= 0.01


def test_a_stage_that_recomputes_nothing_answers_no_to_a_recompute_action() -> None:
    stage, sleeper, torch = sleeping_stage(recompute=False)
    assert not stage.recompute_next()
    stage(torch.zeros(2, 8, 16, requires_grad=True)).sum().backward()
    assert [kind for kind, *_ in sleeper.events] == ["F", "B"]


def test_the_simulator_draws_each_stage_s_computes_in_time_order() -> None:
    times = [StageTimes(1.0, 2.0, 1.0)] * 2
    result = simulate("shifted-1f1b", 2, times, no_wire(2), no_wire(2))
    stage0 = [(kind, mb) for stage, kind, mb, *_ in result.timeline if stage == 0]
    assert stage0 == [("F", 0), ("F", 1), ("R", 0), ("B", 0), ("R", 1), ("B", 1)]
    ends = [end for *_, end in result.timeline]
    assert max(ends) == pytest.approx(result.step_s)
