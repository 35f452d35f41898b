"""The link probe (fits, files, a real run on loopback) and the hybrid plan's cost model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from thinwire.launch import run_local
from thinwire.parallel.interleaved_program import held_in_turn
from thinwire.plan.cost import BucketCost, MethodCost
from thinwire.plan.cpu_sharing import probe_slowdowns
from thinwire.plan.hybrid_cost import (
    Degrees,
    PlanOnLinks,
    StageCost,
    fitted_link,
    largest_sharing_group,
    predict_plan,
)
from thinwire.plan.network import Collective, collective_time
from thinwire.plan.probe import (
    BACK_TO_BACK,
    LARGEST_BYTES,
    Fit,
    LinkProbe,
    PointToPoint,
    back_to_back,
    fit_line,
    hosts_of,
    measured_sizes,
    median_of_slowest,
    run_probe,
)
from thinwire.plan.probe_sharing import in_turn_share, share_at
from thinwire.plan.schedule_sim import StageTimes, simulate
from thinwire.plan.shared_links import in_turn_for, simulate_shared


def _probe(hosts: int = 2, per_host: int = 4) -> LinkProbe:
    """A probe of a made-up cluster: 100 Mbit/s between hosts (halved per pair when all
    cross at once), 8 Gbit/s within a host, CPU shared 2x."""
    between = 8 / 100e6
    return LinkProbe(
        hosts=hosts,
        ranks_per_host=per_host,
        point_to_point=(
            PointToPoint(1e-3, between, 500e3, 1),
            PointToPoint(1e-3, between * per_host, 100e3, per_host),
        ),
        intra_allreduce={2: Fit(1e-4, 8 / 8e9), per_host: Fit(2e-4, 8 / 8e9)},
        inter_allreduce={
            1: Fit(2e-3, between, overlap=0.8, overlaps=((65536.0, 0.8), (1048576.0, 0.4))),
            per_host: Fit(2e-3, between * per_host),
        },
        cpu_slowdown=2.0,
        collectives_at_once=3,
    )


def test_fit_line_recovers_latency_and_bandwidth():
    points = [(s, 0.003 + s * 1e-8) for s in (1e5, 1e6, 1e7)]
    intercept, slope = fit_line(points)
    assert intercept == pytest.approx(0.003)
    assert slope == pytest.approx(1e-8)
    with pytest.raises(ValueError, match="two sizes"):
        fit_line(points[:1])
    with pytest.raises(ValueError, match="did not grow"):
        fit_line([(1e5, 0.2), (1e6, 0.1)])


def test_a_probe_saves_and_loads_and_a_bad_file_says_what_to_run(tmp_path):
    probe = _probe()
    assert LinkProbe.load(probe.save(tmp_path / "links.json")) == probe
    (tmp_path / "bad.json").write_text('{"hosts": 2}')
    with pytest.raises(ValueError, match="thinwire probe"):
        LinkProbe.load(tmp_path / "bad.json")


def _skewed_allreduce_first_sample(rank: int) -> float:
    """The intra-host all-reduce's smallest sample when rank 1 leaves every barrier 40 ms
    after the others, as a loaded host's rank may."""
    import time

    import torch.distributed as dist

    from thinwire.plan import probe as probe_module

    barrier = dist.barrier

    def late_barrier(*args, **kwargs):
        barrier(*args, **kwargs)
        if rank == 1:
            time.sleep(0.04)

    dist.barrier = late_barrier
    try:
        fit = probe_module._probe_allreduce([[0, 1], [2, 3]], target_s=0.02, repeats=1)
    finally:
        dist.barrier = barrier
    return fit.samples[0][1]


def _probe_on_loopback(rank: int, world: int) -> dict:
    probe = run_probe(ranks_per_host=2, target_s=0.02, repeats=1)
    # a job of 1 s on every rank but the last (3 s), which runs it only with all four
    uneven = probe_slowdowns(rank, world, 3, job=lambda: 3.0 if rank == 3 else 1.0)
    return {
        "uneven": uneven,
        "skewed": _skewed_allreduce_first_sample(rank),
        "pairs": [p.pairs for p in probe.point_to_point],
        "intra": sorted(probe.intra_allreduce),
        "inter": sorted(probe.inter_allreduce),
        "betas": [p.beta_s for p in probe.point_to_point]
        + [f.beta_s for f in (*probe.intra_allreduce.values(), *probe.inter_allreduce.values())],
        "slowdown": probe.cpu_slowdown,
        "slowdowns": probe.cpu_slowdowns,
        "overlaps": [
            f.overlap for f in (*probe.intra_allreduce.values(), *probe.inter_allreduce.values())
        ],
        "per_size": [
            ([b for b, _ in f.overlaps], [b for b, _ in f.samples])
            for f in (*probe.intra_allreduce.values(), *probe.inter_allreduce.values())
        ],
        "at_once": probe.collectives_at_once,
        "in_turn": [
            (
                p.pairs,
                [b for b, _ in p.in_turn],
                [b for b, _ in p.samples],
                [x for _, x in p.in_turn],
            )
            for p in probe.point_to_point
        ],
    }


@pytest.mark.timeout(240)
def test_the_probe_runs_on_every_rank_and_agrees():
    results = run_local(_probe_on_loopback, 4, timeout=200)
    assert all(r == results[0] for r in results)  # every rank returns the same probe
    first = results[0]
    # the slowest rank's time, not rank 0's: rank 3 runs only with all four
    assert first["uneven"] == {1: 1.0, 2: 1.0, 4: 3.0}
    assert first["pairs"] == [1, 2]  # one pair alone, then both ranks of host 0
    assert first["intra"] == [2] and first["inter"] == [1, 2]
    assert all(beta > 0 for beta in first["betas"])
    assert first["slowdown"] > 0
    # the CPU job with 1, 2 and 4 ranks at once; every rank's the last point
    assert [c for c, _ in first["slowdowns"]] == [1, 2, 4]
    assert first["slowdowns"][0][1] == 1.0 and first["slowdowns"][-1][1] == first["slowdown"]
    assert len(first["overlaps"]) == 3 and all(0.0 <= o <= 1.0 for o in first["overlaps"])
    # two at once measured at every size the fit measured
    assert all(sizes == measured and len(sizes) >= 3 for sizes, measured in first["per_size"])
    assert first["at_once"] == 2  # gloo's worker threads, read from the group
    # both pairs sending at once: served in turn or side by side, at every size measured
    (alone, _, _, none), (both, sizes, measured, shares) = first["in_turn"]
    assert alone == 1 and none == [] and both == 2 and sizes == measured
    assert all(0.0 <= share <= 1.0 for share in shares)
    # a rank 40 ms late out of the barrier: timed one transfer alone it would count all
    # 40 ms; back to back it is spread over BACK_TO_BACK (8) transfers
    assert first["skewed"] < 0.02


def test_each_repeat_counts_its_slowest_rank_whichever_rank_that_is():
    # two groups sharing a link, each served last in one repeat of three: each rank's own
    # median is the fast 0.1 s, but every step waits for whichever group is last
    repeats = [[0.3, 0.1], [0.1, 0.3], [0.1, 0.1], [0.35, 0.1], [0.1, 0.32]]
    assert median_of_slowest(repeats) == pytest.approx(0.3)
    by_rank = max(sorted(times)[len(times) // 2] for times in zip(*repeats, strict=True))
    assert by_rank == pytest.approx(0.1)  # what the probe measured before
    assert median_of_slowest([[0.2]]) == 0.2
    with pytest.raises(ValueError, match="at least one repeat"):
        median_of_slowest([])


def test_transfers_are_timed_back_to_back_fewer_as_they_grow():
    assert back_to_back(0.0, 0.25) == BACK_TO_BACK  # nothing known yet: the most
    assert back_to_back(0.001, 0.25) == BACK_TO_BACK
    assert back_to_back(0.1, 0.25) == 2
    assert back_to_back(1.0, 0.25) == 1  # never none
    counts: list[int] = []

    def measure(nbytes: int, count: int) -> float:
        counts.append(count)
        return nbytes * 1e-8  # 64 KB: 0.66 ms, growing fourfold a size

    samples = measured_sizes(measure, target_s=0.25)
    assert samples[-1][1] >= 0.25 and counts[0] == BACK_TO_BACK
    assert counts == sorted(counts, reverse=True) and counts[-1] < BACK_TO_BACK
    # each size's count from the size before it, four times as long a transfer
    assert counts[1:] == [back_to_back(4 * t, 0.25) for _, t in samples[:-1]]


def test_the_share_of_latency_hidden_follows_the_size_measured():
    fit = Fit(1e-3, 1e-8, overlap=0.9, overlaps=((4096.0, 0.8), (65536.0, 0.4), (1048576.0, 0.2)))
    assert fit.overlap_at(1024) == 0.8  # below the smallest size: the smallest's
    assert fit.overlap_at(4096) == pytest.approx(0.8)
    assert fit.overlap_at(16384) == pytest.approx(0.6)  # half-way in the logarithm
    assert fit.overlap_at(262144) == pytest.approx(0.3)
    assert fit.overlap_at(1 << 30) == 0.2  # above the largest: the largest's
    assert Fit(1e-3, 1e-8, overlap=0.7).overlap_at(1 << 20) == 0.7  # an older probe: one share


def test_the_tensor_parallel_all_reduce_hides_the_share_measured_at_its_size():
    fit = Fit(2e-3, 8 / 100e6, overlap=0.8, overlaps=((65536.0, 0.8), (1048576.0, 0.4)))
    probe = replace(_probe(hosts=4, per_host=1), inter_allreduce={1: fit})
    links = PlanOnLinks(Degrees(1, 1, 4, 2, "1f1b"), probe)
    latency = 2 * 3 * fit.alpha_s
    for nbytes, share in ((65536, 0.8), (1048576, 0.4)):
        hidden, rest = links.tp_allreduce_parts(nbytes)
        assert hidden == pytest.approx(share * latency)
        assert rest == pytest.approx(2 * 3 / 4 * nbytes * fit.beta_s + (1 - share) * latency)


def _read_collectives_at_once(rank: int, world: int) -> tuple:
    import torch.distributed as dist

    from thinwire.plan.probe import gloo_threads, group_collectives_at_once

    return gloo_threads(dist.group.WORLD), group_collectives_at_once(dist.group.WORLD)


def test_gloo_groups_run_as_many_collectives_at_once_as_they_have_threads():
    # read from the live group (not the fallback): PyTorch makes gloo groups with 2 threads
    assert run_local(_read_collectives_at_once, 1, timeout=60) == [(2, 2)]


def test_two_all_reduces_at_once_tell_how_much_latency_they_hide():
    from thinwire.plan.probe import latency_overlap

    # one alone: 3 ms of latency and 1 ms of bytes
    assert latency_overlap(8e-3, 1e-3, 3e-3) == pytest.approx(0.0)  # twice one: none hidden
    assert latency_overlap(5e-3, 1e-3, 3e-3) == pytest.approx(1.0)  # bytes only: all hidden
    assert latency_overlap(6.5e-3, 1e-3, 3e-3) == pytest.approx(0.5)
    assert latency_overlap(9e-3, 1e-3, 3e-3) == 0.0  # slower than twice one: clamped


def test_the_probe_refuses_a_world_that_is_not_whole_hosts():
    assert hosts_of(8, 4) == 2
    with pytest.raises(ValueError, match="ranks-per-host"):
        hosts_of(8, 3)
    with pytest.raises(ValueError, match="ranks-per-host"):
        hosts_of(8, 0)


def test_data_parallel_alone_is_compute_then_exchange_then_optimizer():
    probe = _probe()
    cost = MethodCost(
        "dense",
        (BucketCost(1.0, 0.0, (Collective("allreduce", 40_000_000),)),),
        dense_bytes=40_000_000,
    )
    stage = StageCost(0.5, 1.0, dp_cost=cost, optimizer_s=0.1)
    predicted = predict_plan(Degrees(dp=8, pp=1, tp=1), [stage], probe)
    # one ring of 8 over 2 hosts: one group crosses, alone
    exchange = collective_time("allreduce", 40e6, 8, fitted_link(probe.inter_allreduce[1]))
    loss = 2 * probe.inter_allreduce[1].alpha_s
    assert predicted.step_s == pytest.approx(1.5 + exchange + 0.1 * 2.0 + loss)
    assert predicted.data_parallel_s == pytest.approx(exchange)


def test_tensor_parallel_groups_inside_a_host_use_the_host_link():
    probe = _probe()
    stage = StageCost(0.1, 0.2, forward_allreduces=(8_000_000,), backward_allreduces=(8_000_000,))
    predicted = predict_plan(Degrees(dp=2, pp=1, tp=4), [stage], probe)
    fit = probe.intra_allreduce[4]
    one = 6 * fit.alpha_s + 1.5 * 8e6 * fit.beta_s
    assert predicted.tensor_s == pytest.approx(2 * one)
    assert predicted.pipeline_s == pytest.approx(0.3 + 2 * one)


def test_pipeline_messages_cross_hosts_on_one_link_the_stage_ranks_share():
    probe = _probe()
    degrees = Degrees(dp=2, pp=2, tp=2, microbatches=4)
    links = PlanOnLinks(degrees, probe)
    # stage 0 is host 0 (4 ranks), stage 1 host 1: all four pairs cross the same link
    message, per_replica = links.message(0, 1_000_000)
    assert message.serialise_s == pytest.approx(1e6 * probe.point_to_point[0].beta_s)
    assert len(per_replica) == 4 and len(set(per_replica)) == 1
    stages = [StageCost(0.1, 0.2, activation_bytes=1_000_000)] * 2
    predicted = predict_plan(degrees, stages, probe)
    # replicas (dp, tp): (0, 0), (0, 1), (1, 0), (1, 1); a replica's two tensor-parallel
    # ranks start each pass together
    times = simulate(
        "1f1b", 4, [StageTimes(0.1, 0.2)] * 2, [message], [message], replicas=4,
        links=[per_replica], together=[[0, 1], [2, 3]],
    )  # fmt: skip
    assert predicted.pipeline_s == pytest.approx(times.step_s)
    assert predicted.bubble_s == pytest.approx(times.step_s - 4 * 0.3)
    apart = simulate(
        "1f1b", 4, [StageTimes(0.1, 0.2)] * 2, [message], [message], replicas=4,
        links=[per_replica],
    )  # fmt: skip
    assert times.step_s > apart.step_s  # one that got its message first waits for its pair
    # four pipelines on one link wait for each other's messages; one alone does not
    alone = simulate("1f1b", 4, [StageTimes(0.1, 0.2)] * 2, [message], [message])
    assert times.step_s > alone.step_s + message.serialise_s


def test_a_shared_link_is_simulated_as_served_in_turn_as_the_probe_found_it():
    in_turn = replace(_probe().point_to_point[1], in_turn=((65536.0, 1.0), (4194304.0, 0.0)))
    probe = replace(_probe(), point_to_point=(_probe().point_to_point[0], in_turn))
    assert in_turn_for(probe, [65536, 65536]) == 1.0  # bursts queue one after another
    assert in_turn_for(probe, [4194304]) == 0.0  # large ones interleave
    assert in_turn_for(probe, [524288]) == pytest.approx(0.5)
    assert in_turn_for(_probe(), [4194304]) == 1.0  # not measured: in turn, as before
    degrees = Degrees(dp=2, pp=2, tp=2, microbatches=4)
    links = PlanOnLinks(degrees, probe)
    message, per_replica = links.message(0, 4194304)
    step = dict(schedule="1f1b", microbatches=4, stages=[StageTimes(0.1, 0.2)] * 2,
                forward=[message], backward=[message], replicas=4, links=[per_replica],
                together=[[0, 1], [2, 3]])  # fmt: skip
    fluid, fifo = simulate(**step, sharing="fluid"), simulate(**step, sharing="fifo")
    assert fluid.step_s > fifo.step_s  # in step, every pipeline waits for all four
    assert simulate_shared(0.0, **step) == fluid and simulate_shared(1.0, **step) == fifo
    between = simulate_shared(0.25, **step)
    assert between.step_s == pytest.approx(0.25 * fifo.step_s + 0.75 * fluid.step_s)
    with pytest.raises(ValueError, match="between 0 and 1"):
        simulate_shared(1.5, **step)
    for nbytes, expected in ((4194304, fluid), (65536, None)):
        stages = [StageCost(0.1, 0.2, activation_bytes=nbytes)] * 2
        if expected is None:
            message, per_replica = links.message(0, nbytes)
            expected = simulate(**{**step, "forward": [message], "backward": [message]})
        assert predict_plan(degrees, stages, probe).pipeline_s == pytest.approx(expected.step_s)


def test_the_share_served_in_turn_comes_from_when_messages_sent_together_arrive():
    assert in_turn_share([0.25, 0.5, 0.75, 1.0]) == pytest.approx(1.0)  # one after another
    assert in_turn_share([1.0, 1.0, 1.0, 1.0]) == pytest.approx(0.0)  # together
    assert in_turn_share([0.6, 1.0]) == pytest.approx(0.8)
    assert in_turn_share([0.1, 1.0]) == 1.0  # clamped
    with pytest.raises(ValueError, match="two messages"):
        in_turn_share([1.0])
    with pytest.raises(ValueError, match="not all 0"):
        in_turn_share([0.0, 0.0])
    shares = ((65536.0, 1.0), (1048576.0, 0.0))
    assert share_at(shares, 1024) == 1.0 and share_at(shares, 1 << 30) == 0.0
    assert share_at(shares, 262144) == pytest.approx(0.5)  # half-way in the logarithm
    assert share_at((), 262144) is None


def test_pipeline_messages_within_a_host_each_have_their_own_link():
    links = PlanOnLinks(Degrees(dp=2, pp=4, tp=1, microbatches=4), _probe())
    # stages 0 and 1 (ranks 0-3) share host 0: boundary 0 stays home, boundary 1 crosses
    _, home = links.message(0, 1_000)
    _, across = links.message(1, 1_000)
    assert len(set(home)) == 2 and len(set(across)) == 1


def test_a_plan_for_another_cluster_is_refused():
    with pytest.raises(ValueError, match="plan for the cluster the probe ran on"):
        predict_plan(Degrees(dp=4, pp=1, tp=1), [StageCost(1.0, 1.0)], _probe())
    with pytest.raises(ValueError, match="a cost per stage"):
        predict_plan(Degrees(dp=4, pp=2, tp=1), [StageCost(1.0, 1.0)], _probe())


def test_the_probe_command_outside_a_job_says_how_to_launch_it(monkeypatch, capsys):
    from thinwire.cli import main

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(["probe", "--out", "unused.json"]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_interleaved_plans_fold_two_stages_onto_each_rank():
    """Interleaved 1F1B on pp=2: four stages, stage s on pipeline rank s % 2; the wrap
    boundary (stage 1 on rank 1 to stage 2 on rank 0) crosses hosts back; each rank's
    memory and exchange are its two stages' together."""
    probe = _probe()
    degrees = Degrees(dp=4, pp=2, tp=1, microbatches=4, schedule="interleaved-1f1b")
    links = PlanOnLinks(degrees, probe)
    _, across = links.message(0, 1_000)  # rank 0 (host 0) to rank 1 (host 1)
    _, back = links.message(1, 1_000)  # rank 1 (host 1) to rank 0 (host 0)
    assert len(set(across)) == 1 and len(set(back)) == 1
    cost = MethodCost(
        "dense",
        (BucketCost(1.0, 0.0, (Collective("allreduce", 4_000_000),)),),
        dense_bytes=4_000_000,
    )
    stages = [
        StageCost(0.1, 0.2, activation_bytes=1_000, dp_cost=cost, saved_bytes=100 * (s + 1))
        for s in range(4)
    ]
    predicted = predict_plan(degrees, stages, probe)
    assert len(predicted.stage_end_s) == len(predicted.memory) == 2
    messages = [links.message(b, 1_000) for b in range(3)]
    times = simulate(
        "interleaved-1f1b", 4, [StageTimes(0.1, 0.2)] * 4, [m for m, _ in messages],
        [m for m, _ in messages], replicas=1, links=[[r[0]] for _, r in messages],
    )  # fmt: skip
    assert predicted.pipeline_s >= times.step_s  # four replicas share the links, not one
    # a rank's two stages peak at different times: its peak is of their sum, in turn
    for k in range(2):
        over_time = [
            sum(100 * (s + 1) * n for s, n in held.items()) for held in held_in_turn(k, 2, 4)
        ]
        separately = sum(100 * (s + 1) * times.peak_in_flight[s] for s in (k, k + 2))
        assert predicted.memory[k]["activations"] == max(over_time) < separately
    one_exchange = cost.comm_time(4, links.dp_link(0)[0])
    assert predicted.data_parallel_s == pytest.approx(2 * one_exchange)
    with pytest.raises(ValueError, match=r"a cost per stage \(4\)"):
        predict_plan(degrees, stages[:2], probe)


def test_replicas_that_share_a_hosts_uplink_are_simulated_together():
    """Two pipelines leaving host 0 for different hosts queue at its uplink, and two whose
    gradients and activations both leave host 1 at its: one group each time; pipelines on
    hosts of their own stay apart."""
    assert largest_sharing_group(2, [[(0, 1), (0, 2)]]) == [0, 1]
    assert largest_sharing_group(2, [[(1, 0), (2, 1)]]) == [0, 1]  # host 1 sends either way
    assert len(largest_sharing_group(2, [[(0, 1), (2, 3)]])) == 1
    assert len(largest_sharing_group(3, [["a", "b", "c"], ["a", "b", "c"]])) == 1


def test_a_level_of_several_flows_is_measured_up_to_the_one_flow_level_s_largest_size():
    def measure(nbytes: int, count: int) -> float:
        return nbytes * 1e-7  # 64 KB: 6.6 ms; past the target at 4 MiB

    alone = measured_sizes(measure, target_s=0.25)
    assert [b for b, _ in alone] == [65536.0, 262144.0, 1048576.0, 4194304.0]
    # four flows at once reach the target at 1 MiB; they go on to the size one flow reached
    shared = [b for b, _ in measured_sizes(lambda n, c: 4 * measure(n, c), 0.25)]
    assert shared == [65536.0, 262144.0, 1048576.0]
    reached = measured_sizes(lambda n, c: 4 * measure(n, c), 0.25, at_least=alone[-1][0])
    assert [b for b, _ in reached] == [b for b, _ in alone]
    # never past the largest size a probe measures
    capped = measured_sizes(measure, 0.25, at_least=4.0 * LARGEST_BYTES)
    assert capped[-1][0] == LARGEST_BYTES
