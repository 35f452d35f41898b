"""Interleaved 1F1B's programs: the lowered lists are PyTorch's own, and the simulator
runs them to the textbook's step where the messages cost nothing."""

from __future__ import annotations

import pytest

from thinwire.parallel.interleaved_program import compute_order, interleaved_programs, lowered
from thinwire.plan.schedule_sim import Message, StageTimes, simulate

SHAPES = [(2, 2), (2, 4), (2, 6), (3, 3), (4, 4), (4, 8), (4, 12), (2, 1), (4, 2), (8, 16)]


def torch_lowered(ranks: int, microbatches: int) -> dict[int, list[str]] | None:
    """PyTorch's ScheduleInterleaved1F1B lowered for ``ranks`` (stand-in stages: only
    their indices and group are read), or None where this PyTorch builds it otherwise."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

    class Stand:
        def __init__(self, index: int, rank: int) -> None:
            self.stage_index, self.group_size, self.group_rank = index, ranks, rank
            self.num_stages, self.has_backward, self.submod = 2 * ranks, True, None
            self.is_first, self.is_last = index == 0, index == 2 * ranks - 1

    try:
        built = schedules.ScheduleInterleaved1F1B([Stand(0, 0), Stand(ranks, 0)], microbatches)
    except Exception:
        return None
    skipped = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
    return {
        rank: [str(a) for a in actions if not any(s in str(a) for s in skipped)]
        for rank, actions in built.pipeline_order_with_comms.items()
    }


def spelled(action: tuple) -> str:
    if action[0] in ("send", "recv"):
        return f"{action[2]}{action[0].upper()}_{action[1]}{action[3]}"
    return f"{action[1]}{action[0]}{action[2]}"


@pytest.mark.parametrize(("ranks", "microbatches"), SHAPES)
def test_lowered_lists_are_pytorchs(ranks: int, microbatches: int) -> None:
    theirs = torch_lowered(ranks, microbatches)
    if theirs is None:
        pytest.skip("this PyTorch's ScheduleInterleaved1F1B cannot be built from stand-ins")
    ours = {
        rank: [spelled(a) for a in actions]
        for rank, actions in lowered(ranks, microbatches).items()
    }
    assert ours == theirs


def test_every_stage_runs_each_microbatch_forward_then_backward_once() -> None:
    ranks, m = 4, 8
    seen: dict[tuple[str, int], list[int]] = {}
    for rank in range(ranks):
        for slot in compute_order(rank, ranks, m):
            if slot is not None:
                kind, stage, mb = slot
                assert stage % ranks == rank
                seen.setdefault((kind, stage), []).append(mb)
    assert all(mbs == list(range(m)) for mbs in seen.values())
    assert len(seen) == 2 * 2 * ranks


def test_micro_batches_that_do_not_fill_rounds_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of their rounds"):
        compute_order(0, 4, 9)


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 4), (4, 8), (4, 4)])
def test_free_messages_give_the_textbook_step(ranks: int, microbatches: int) -> None:
    """With equal chunks and free messages, interleaved 1F1B's step is the work plus the
    bubble (p - 1)(F + B) / v, v = 2 chunks a rank of F + B = 2 (f + b) each (Narayanan et
    al.): half of 1F1B's on the same ranks."""
    f, b = 1.0, 2.0
    stages = [StageTimes(f, b)] * (2 * ranks)
    free = [Message(0.0)] * (2 * ranks - 1)
    times = simulate("interleaved-1f1b", microbatches, stages, free, free)
    work = 2 * microbatches * (f + b)
    assert times.step_s == pytest.approx(work + (ranks - 1) * 2 * (f + b) / 2)
    one = simulate(
        "1f1b", microbatches, [StageTimes(2 * f, 2 * b)] * ranks, *[free[: ranks - 1]] * 2
    )
    assert one.step_s == pytest.approx(work + (ranks - 1) * 2 * (f + b))  # twice the bubble


def test_a_recomputing_stage_recomputes_inside_its_backward() -> None:
    programs = interleaved_programs(2, 2, recompute=(False, True, False, False))
    rank1 = programs[1]
    recomputes = [op for op in rank1 if op[0] == "compute" and op[1] == "R"]
    assert [op[4] for op in recomputes] == [1, 1] and all(
        op[3] == "in-backward" for op in recomputes
    )
