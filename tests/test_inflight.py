"""All-reduces in flight on one group: the link shared as a fluid, hidden latency, the
group's limit on collectives at once (the sub-batches' cost model)."""

from __future__ import annotations

import pytest

from thinwire.plan.inflight import InFlight


def test_one_alone_takes_its_rest_then_its_hidden_latency() -> None:
    group = InFlight()
    first = group.issue(1.0, rest=2.0, hidden=0.5)
    assert group.end(first) == pytest.approx(3.5)


def test_two_issued_together_end_when_the_probe_timed_them() -> None:
    # the probe's calibration: two at once take 2 rest + hidden
    group = InFlight()
    a, b = group.issue(0.0, 0.75, 0.5), group.issue(0.0, 0.75, 0.5)
    assert group.end(a) == pytest.approx(2.0) and group.end(b) == pytest.approx(2.0)


def test_all_reduces_in_flight_share_the_link_equally() -> None:
    group = InFlight()
    a = group.issue(0.0, 1.0, 0.0)
    b = group.issue(0.5, 1.0, 0.0)
    # a has 0.5 left when b starts; both at half speed: a ends at 1.5 (not 1.0, first come
    # first served), b has 0.5 left then and ends alone at 2.0
    assert group.end(a) == pytest.approx(1.5)
    assert group.end(b) == pytest.approx(2.0)
    c = group.issue(3.0, 0.25, 0.0)  # after both ended: alone again
    assert group.end(c) == pytest.approx(3.25)


def test_a_group_runs_at_most_at_once_and_the_rest_wait_in_order() -> None:
    group = InFlight(at_once=1)
    a, b = group.issue(0.0, 1.0, 1.0), group.issue(0.0, 1.0, 1.0)
    assert group.end(a) == pytest.approx(2.0)
    assert group.end(b) == pytest.approx(4.0)  # starts when a ends, the link its own
    two = InFlight(at_once=2)
    ends = [two.end(i) for i in [two.issue(0.0, 0.0, 1.0) for _ in range(3)]]
    assert ends == pytest.approx([1.0, 1.0, 2.0])  # the third waits for a runner


def test_bad_use_is_refused_with_what_was_wrong() -> None:
    with pytest.raises(ValueError, match="at least one collective"):
        InFlight(at_once=0)
    group = InFlight()
    group.issue(2.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="time order"):
        group.issue(1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="never issued"):
        group.end(7)
