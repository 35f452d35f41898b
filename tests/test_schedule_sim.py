"""The pipeline schedule simulation: pure arithmetic, one process."""

from __future__ import annotations

import pytest

from thinwire.plan.schedule_sim import Message, StageTimes, simulate

SCHEDULES = ("gpipe", "1f1b")


def _free(stages: int) -> list[Message]:
    return [Message(0.0, 0.0)] * (stages - 1)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 3), (2, 4), (4, 8), (3, 5)])
def test_without_communication_the_step_is_the_textbook_pipeline(schedule, stages, microbatches):
    forward, backward = 1.0, 2.0
    times = simulate(
        schedule,
        microbatches,
        [StageTimes(forward, backward)] * stages,
        _free(stages),
        _free(stages),
    )
    assert times.step_s == pytest.approx((microbatches + stages - 1) * (forward + backward))
    assert times.stage_busy_s == pytest.approx([microbatches * (forward + backward)] * stages)
    assert times.bubble_s == pytest.approx((stages - 1) * (forward + backward))


def test_the_slowest_stage_sets_the_pace():
    stages = [StageTimes(1.0, 2.0), StageTimes(3.0, 6.0)]
    times = simulate("1f1b", 8, stages, _free(2), _free(2))
    # the slow stage works all the time once its first micro-batch arrives
    assert times.step_s == pytest.approx(1.0 + 8 * 9.0 + 2.0)


def test_activations_in_flight_follow_the_schedule():
    stages = [StageTimes(1.0, 2.0)] * 4
    assert simulate("gpipe", 8, stages, _free(4), _free(4)).peak_in_flight == (8, 8, 8, 8)
    assert simulate("1f1b", 8, stages, _free(4), _free(4)).peak_in_flight == (4, 3, 2, 1)
    assert simulate("1f1b", 2, stages[:2], _free(2), _free(2)).peak_in_flight == (2, 1)


def test_gpipe_on_a_slow_link_sends_one_message_at_a_time():
    # no compute: forward messages follow one another, then the gradients
    transfer = 1.0
    link = [Message(transfer, 0.0)]
    times = simulate("gpipe", 4, [StageTimes(0.0, 0.0)] * 2, link, link)
    assert times.step_s == pytest.approx(2 * 4 * transfer)


def test_ready_notes_queue_behind_data_so_1f1b_does_not_overlap_the_two_ways():
    # measured on the emulated cluster (10 Mbit/s, 1 MiB per micro-batch): 7.2 s a step;
    # ways overlapping would take about 5.1 s, the ready notes behind data make it 7.1 s
    link = [Message(0.87, 0.001, 0.5)]
    stages = [StageTimes(0.01, 0.01)] * 2
    times = simulate("1f1b", 4, stages, link, link)
    assert 2 * 4 * 0.87 <= times.step_s <= 2 * 4 * 0.87 + 0.2


def test_latency_delays_every_hop():
    stages = [StageTimes(0.0, 0.0)] * 3
    link = [Message(0.0, 0.5)] * 2
    times = simulate("gpipe", 1, stages, link, link)
    # the first send waits for its ready note (one latency), then the data goes forward
    # two hops and back two hops; every later ready note was sent in time
    assert times.step_s == pytest.approx(5 * 0.5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("zero-bubble", 4, [StageTimes(1, 1)] * 2, _free(2), _free(2)), "simulates"),
        (("interleaved-1f1b", 4, [StageTimes(1, 1)] * 2, _free(2), _free(2)), "two stages"),
        (
            (
                "interleaved-1f1b",
                4,
                [StageTimes(1, 1)] * 6 + [StageTimes(1, 1)],
                _free(7),
                _free(7),
            ),
            "two stages",
        ),
        (("1f1b", 0, [StageTimes(1, 1)] * 2, _free(2), _free(2)), "micro-batches"),
        (("1f1b", 2.0, [StageTimes(1, 1)] * 2, _free(2), _free(2)), "micro-batches"),
        (("1f1b", 2, [], [], []), "at least one stage"),
        (("1f1b", 2, [StageTimes(1, 1)] * 3, _free(2), _free(3)), "boundaries"),
    ],
)
def test_bad_input_is_refused_with_a_reason(args, message):
    with pytest.raises(ValueError, match=message):
        simulate(*args)


def test_negative_times_are_refused():
    with pytest.raises(ValueError, match="forward_s"):
        StageTimes(-1.0, 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        Message(1.0, -0.1)
    with pytest.raises(ValueError, match=">= 0"):
        Message(1.0, 0.0, -1.0)


def test_replicas_on_one_link_take_turns_and_on_their_own_links_do_not():
    link = [Message(1.0, 0.0)]
    stages = [StageTimes(0.1, 0.1)] * 2
    alone = simulate("gpipe", 2, stages, link, link)
    private = simulate("gpipe", 2, stages, link, link, replicas=3)
    shared = simulate("gpipe", 2, stages, link, link, replicas=3, links=[["host0-host1"] * 3])
    assert private.step_s == pytest.approx(alone.step_s)
    # three pipelines' messages through one link: the last replica waits for the others
    assert shared.step_s > 2 * alone.step_s
    with pytest.raises(ValueError, match="a link per replica"):
        simulate("gpipe", 2, stages, link, link, replicas=3, links=[["a", "b"]])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("microbatches", [2, 4])
def test_a_fluid_link_to_itself_is_the_first_in_first_out_one(schedule, microbatches):
    link = [Message(0.87, 0.001, 0.5)]
    stages = [StageTimes(0.05, 0.1), StageTimes(0.07, 0.12)]
    fifo = simulate(schedule, microbatches, stages, link, link, replicas=2)
    fluid = simulate(schedule, microbatches, stages, link, link, replicas=2, sharing="fluid")
    assert fluid.stage_end_s == pytest.approx(fifo.stage_end_s)


def test_on_a_fluid_link_messages_share_the_bandwidth_and_finish_together():
    # one micro-batch, no compute: both replicas' activations leave at once
    link, stages = [Message(1.0, 0.0)], [StageTimes(0.0, 0.0)] * 2
    shared = [["host0-host1"] * 2]
    fifo = simulate("gpipe", 1, stages, link, link, replicas=2, links=shared)
    fluid = simulate("gpipe", 1, stages, link, link, replicas=2, links=shared, sharing="fluid")
    # fluid: both activations arrive at 2 s, both gradients at 4 s. First in, first out:
    # the activations at 1 s and 2 s, and the first gradient's ready note waits behind the
    # second activation on the link, so the gradients arrive at 3 s and 4 s
    assert fluid.step_s == pytest.approx(4.0)
    assert fifo.step_s == pytest.approx(4.0)
    uneven = [StageTimes(0.0, 0.0), StageTimes(0.0, 3.0)]  # the receiver computes 3 s
    fifo = simulate("gpipe", 1, uneven, link, link, replicas=2, links=shared)
    fluid = simulate("gpipe", 1, uneven, link, link, replicas=2, links=shared, sharing="fluid")
    # first in first out: activations at 1 and 2, backward done at 4 and 5, gradients
    # 4-5 and 5-6; fluid: activations both at 2, backward done at 5, gradients 5-7
    assert fifo.step_s == pytest.approx(6.0)
    assert fluid.step_s == pytest.approx(7.0)
    with pytest.raises(ValueError, match="fluid"):
        simulate("gpipe", 1, stages, link, link, sharing="fair")


@pytest.mark.parametrize("sharing", ["fifo", "fluid"])
def test_a_host_sends_forward_and_backward_through_one_uplink(sharing):
    """Interleaved 1F1B over four hosts: each host sends activations to the next host and
    gradients to the one before, both through its uplink, so links named by their two
    hosts queue them together, where a link per pair of hosts and way would not."""
    stages = [StageTimes(0.2, 0.4)] * 8
    link = [Message(1.0)] * 7
    hosts = [[(s % 4, (s + 1) % 4)] for s in range(7)]
    pairs = [[f"{s % 4}-{(s + 1) % 4}"] for s in range(7)]  # a queue per pair of ranks
    shared = simulate("interleaved-1f1b", 8, stages, link, link, links=hosts, sharing=sharing)
    apart = simulate("interleaved-1f1b", 8, stages, link, link, links=pairs, sharing=sharing)
    assert shared.step_s > apart.step_s + 5  # messages each way wait for the other way's


def test_tensor_parallel_ranks_start_each_pass_together():
    # two replicas (a stage's two tensor-parallel ranks) share one link, in turn: the first
    # replica's micro-batch arrives at 1.5 s, the second's at 2.5 s
    stages = [StageTimes(0.5, 0.0)] * 2
    forward, backward = [Message(1.0, 0.0)], [Message(0.0, 0.0)]
    shared = {"replicas": 2, "links": [["host0-host1"] * 2]}
    apart = simulate("gpipe", 2, stages, forward, backward, **shared)
    together = simulate("gpipe", 2, stages, forward, backward, together=[[0, 1]], **shared)
    # apart, the first runs ahead: its forward 1.5-2.0, its next message 2.5-3.5 (behind
    # the second's first), its forward 3.5-4.0; the second's ends at 5.0
    assert [e[3] for e in apart.timeline if e[:2] == (1, "F")] == [1.5, 3.5]
    assert apart.step_s == pytest.approx(5.0)
    # together, both start at 2.5 (the last arrival), ask for the next at 3.0, get it at 4.0
    # and 5.0, and start it at 5.0: half a second longer
    assert [e[3] for e in together.timeline if e[:2] == (1, "F")] == [2.5, 5.0]
    assert together.step_s == pytest.approx(5.5)
    # on links of their own the replicas keep step anyway: nothing changes
    alone = simulate("gpipe", 2, stages, forward, backward, replicas=2)
    assert simulate(
        "gpipe", 2, stages, forward, backward, replicas=2, together=[[0, 1]]
    ).step_s == pytest.approx(alone.step_s)


@pytest.mark.parametrize("together", [[[0, 0]], [[0, 2]], [[0, 1], [1]]])
def test_together_must_name_distinct_replicas(together):
    stages = [StageTimes(0.5, 0.0)] * 2
    with pytest.raises(ValueError, match="distinct replicas"):
        simulate("gpipe", 2, stages, _free(2), _free(2), replicas=2, together=together)
