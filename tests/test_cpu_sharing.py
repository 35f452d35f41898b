"""The CPU ranks share (:mod:`thinwire.plan.cpu_sharing`): the probe's curve, processor
sharing of the stages' CPU work, and what it changes in a plan's prediction."""

from __future__ import annotations

import pytest

from thinwire.plan.cpu_sharing import concurrency_levels, shared_finish, slowdown_curve
from thinwire.plan.hybrid_cost import Degrees, StageCost, predict_plan
from thinwire.plan.probe import Fit, LinkProbe, PointToPoint

CURVE = [(1, 1.0), (2, 1.1), (4, 2.2), (8, 4.8)]


def test_the_levels_double_up_to_the_world() -> None:
    assert concurrency_levels(8) == [1, 2, 4, 8]
    assert concurrency_levels(6) == [1, 2, 4, 6]
    assert concurrency_levels(1) == [1]


def test_the_curve_interpolates_the_probe_and_an_old_probe_gets_a_line() -> None:
    slowdown = slowdown_curve(CURVE, world=8, every_rank=4.8)
    assert [slowdown(c) for c in (1, 2, 4, 8)] == pytest.approx([1.0, 1.1, 2.2, 4.8])
    assert slowdown(3) == pytest.approx(1.65) and slowdown(6) == pytest.approx(3.5)
    assert slowdown(0.5) == 1.0 and slowdown(16) == pytest.approx(4.8)  # held at the ends
    line = slowdown_curve([], world=8, every_rank=4.5)
    assert line(1) == 1.0 and line(8) == pytest.approx(4.5)
    assert line(4.5) == pytest.approx(1 + 3.5 / 7 * 3.5)


def test_one_group_takes_its_work_times_the_slowdown_of_all_its_ranks() -> None:
    slowdown = slowdown_curve(CURVE, world=8, every_rank=4.8)
    assert shared_finish([1.0], [0.1], [8], slowdown) == pytest.approx([1.0 + 0.1 * 4.8])
    together = shared_finish([0.0] * 4, [0.015] * 4, [2] * 4, slowdown)
    assert together == pytest.approx([0.015 * 4.8] * 4)


def test_staggered_groups_share_less_and_the_work_is_all_done() -> None:
    slowdown = slowdown_curve(CURVE, world=8, every_rank=4.8)
    apart = shared_finish([0.0, 0.03, 0.06, 0.09], [0.015] * 4, [2] * 4, slowdown)
    assert apart == pytest.approx([0.015 * 1.1 + 0.03 * k for k in range(4)])
    # two groups overlapping: the first runs alone, then both at 4 ranks' slowdown
    first, second = shared_finish([0.0, 0.01], [0.02, 0.02], [2, 2], slowdown)
    done_alone = 0.01 / 1.1  # the first's work before the second starts
    both = (0.02 - done_alone) * 2.2  # its rest at 2.2x
    assert first == pytest.approx(0.01 + both)
    left = 0.02 - both / 2.2  # the second's work left when the first ends
    assert second == pytest.approx(first + left * 1.1)
    assert shared_finish([0.5, 0.7], [0.0, 0.1], [4, 4], slowdown)[0] == 0.5  # nothing to do


def _probe(slowdowns: tuple[tuple[int, float], ...]) -> LinkProbe:
    """2 hosts x 4 ranks, 100 Mbit/s between hosts, the CPU 4x slower with all 8 busy."""
    between = 8 / 100e6
    return LinkProbe(
        hosts=2,
        ranks_per_host=4,
        point_to_point=(
            PointToPoint(1e-3, between, 5e5, 1),
            PointToPoint(1e-3, 4 * between, 1e5, 4),
        ),
        intra_allreduce={2: Fit(1e-4, 1e-9), 4: Fit(2e-4, 1e-9)},
        inter_allreduce={1: Fit(2e-3, between), 4: Fit(2e-3, 4 * between)},
        cpu_slowdown=4.0,
        cpu_slowdowns=slowdowns,
    )


def _optimizer_s(pp: int, probe: LinkProbe) -> float:
    stage = StageCost(forward_s=0.05, backward_s=0.1, activation_bytes=100_000, optimizer_s=0.02)
    degrees = Degrees(dp=8 // pp, pp=pp, tp=1, microbatches=4, schedule="1f1b")
    return predict_plan(degrees, [stage] * pp, probe).optimizer_s


def test_a_pipeline_s_stages_pay_less_than_every_rank_at_once() -> None:
    """A 2x4x1 plan's four stages end apart: their optimizer steps, timed with the probe's
    curve, cost less than at every rank's slowdown; a plan without a pipeline is as before."""
    curve, line = _probe(((1, 1.0), (2, 1.0), (8, 4.0))), _probe(())
    piped = _optimizer_s(4, curve)
    assert piped < 0.02 * 4.0 * 0.75  # stages apart: well under every rank's slowdown
    assert _optimizer_s(4, line) > piped  # the line charges two ranks 1.43x, not 1x
    assert _optimizer_s(1, curve) == pytest.approx(0.02 * 4.0)  # one group: every rank's
    assert _optimizer_s(1, line) == pytest.approx(0.02 * 4.0)


def test_the_probe_s_table_shows_the_curve() -> None:
    from rich.console import Console

    from thinwire.plan.probe_command import probe_table

    console = Console(width=120, record=True)
    console.print(probe_table(_probe(((1, 1.0), (2, 1.26), (4, 1.98), (8, 4.0)))))
    text = console.export_text()
    assert "4.00x alone" in text and "1.26x alone" in text and "1.98x alone" in text
    assert "2 ranks" in text and "4 ranks" in text
