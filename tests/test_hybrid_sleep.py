"""Plans timed on virtual accelerators (``thinwire bench --plans --compute sleep``): the cost
model's bytes per link, the kernel's socket counters, the stage profiles, and a run on
emulated hosts whose measured bytes must match both the model and the real step."""

from __future__ import annotations

import json
import socket
import statistics

import pytest
import torch

from thinwire.bench.hybrid import HybridConfig
from thinwire.bench.hybrid_predict import predict_sweep
from thinwire.bench.traffic import Traffic, parse_ss, sent_now
from thinwire.cli import main
from thinwire.cluster import check_can_emulate
from thinwire.parallel.plan_spec import parse_plan
from thinwire.plan.plan_traffic import PlanSizes, coordinates, plan_traffic, rank_at
from thinwire.plan.probe import Fit, LinkProbe, PointToPoint

pytestmark = pytest.mark.timeout(600)

MB = 1_000_000


def sizes(pp: int, dp: int, tp: int, chunks: int = 1, microbatches: int = 1) -> PlanSizes:
    stages = pp * chunks
    return PlanSizes(
        pp=pp, dp=dp, tp=tp, chunks=chunks, microbatches=microbatches,
        tp_allreduce_bytes=[[MB, MB]] * stages,  # two all-reduces of 1 MB per micro-batch
        activation_bytes=[3 * MB] * stages,
        dp_bytes=[10 * MB] * stages,
    )  # fmt: skip


def test_mesh_coordinates_put_tensor_parallel_innermost() -> None:
    s = sizes(2, 2, 2)
    assert [coordinates(r, s) for r in (0, 1, 2, 5, 7)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1),
    ]  # fmt: skip
    assert all(rank_at(*coordinates(r, s), s) == r for r in range(8))


def test_pure_data_parallel_crosses_hosts_only_where_the_ring_does() -> None:
    traffic = plan_traffic(sizes(1, 8, 1), ranks_per_host=4)
    # the ring 0..7: rank 3 sends to 4 and rank 7 to 0 over the slow link, the rest stay home
    assert [t["between_hosts"] for t in traffic] == [0, 0, 0, 10 * MB, 0, 0, 0, 10 * MB]
    assert [t["within_host"] for t in traffic] == [10 * MB] * 3 + [0] + [10 * MB] * 3 + [0]


def test_a_pipeline_across_hosts_sends_activations_forward_and_gradients_back() -> None:
    traffic = plan_traffic(sizes(2, 2, 2, microbatches=4), ranks_per_host=4)
    ring = 2 * (2 - 1) / 2 * (2 * MB) * 4  # tp: 2 x 1 MB per micro-batch, 4 micro-batches
    for t in traffic:
        # stage 0 (ranks 0-3) sends 4 micro-batches of activations; stage 1 their gradients
        assert t["between_hosts"] == 4 * 3 * MB
        assert t["within_host"] == ring + 10 * MB  # tensor and data parallel inside the host
    # one host per rank: now tensor parallelism crosses too
    apart = plan_traffic(sizes(2, 2, 2, microbatches=4), ranks_per_host=1)
    assert all(t["within_host"] == 0 for t in apart)
    assert apart[0]["between_hosts"] == 4 * 3 * MB + ring + 10 * MB


def test_interleaved_chunks_send_around_the_pipeline_ring() -> None:
    # 2 pipeline ranks x 2 chunks: stages 0,2 on pp rank 0 and 1,3 on pp rank 1
    traffic = plan_traffic(sizes(2, 1, 1, chunks=2, microbatches=2), ranks_per_host=1)
    # rank 0: stage 0 sends forward; stage 2 sends forward and back. rank 1: stage 1 both
    # ways, stage 3 back only
    assert traffic[0]["between_hosts"] == 3 * 2 * 3 * MB
    assert traffic[1]["between_hosts"] == 3 * 2 * 3 * MB


def test_bad_ranks_per_host_is_refused() -> None:
    with pytest.raises(ValueError, match="ranks_per_host must be >= 1"):
        plan_traffic(sizes(1, 2, 1), ranks_per_host=0)


SS = """\
0      0      198.18.0.1:41000 198.18.0.2:29500 users:(("python",pid=42,fd=7))
\t cubic rtt:1/1 bytes_sent:5000 bytes_acked:5001 bytes_received:10
0      0      198.18.0.1:41002 198.18.0.1:41003 users:(("python",pid=42,fd=8))
\t cubic rtt:1/1 bytes_sent:700 bytes_acked:701
0      0      198.18.0.1:41004 198.18.0.1:41005 users:(("python",pid=43,fd=8))
\t cubic rtt:1/1 bytes_sent:999 bytes_acked:999
0      0      198.18.0.1:41006 198.18.0.3:41007 users:(("python",pid=42,fd=9))
\t cubic rtt:1/1 bytes_received:123
"""


def test_socket_counters_are_split_by_the_peer_address() -> None:
    assert parse_ss(SS, pid=42) == Traffic(within_host=700, between_hosts=5000)
    assert parse_ss(SS, pid=43) == Traffic(within_host=998, between_hosts=0)
    assert parse_ss(SS, pid=44) == Traffic()


def test_this_process_sees_what_it_sent_over_loopback() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    before = sent_now()
    with socket.create_connection(server.getsockname()) as client:
        peer, _ = server.accept()
        client.sendall(b"x" * 200_000)
        received = 0
        while received < 200_000:
            received += len(peer.recv(1 << 16))
        after = sent_now()
        peer.close()
    server.close()
    sent = after - before
    assert sent.between_hosts == 0
    assert 200_000 <= sent.within_host < 201_000


def test_a_sleeping_run_needs_a_step_after_the_untimed_ones() -> None:
    plans = (parse_plan("2x1x1"),)
    with pytest.raises(ValueError, match="--steps 3 leaves no step to time after the 3"):
        HybridConfig(task="gpt", plans=plans, steps=3, compute="sleep")
    with pytest.raises(ValueError, match="--untimed-steps must be >= 0"):
        HybridConfig(task="gpt", plans=plans, steps=3, compute="sleep", untimed_steps=-1)
    assert HybridConfig(task="gpt", plans=plans, steps=4, compute="sleep").untimed_steps == 3
    HybridConfig(task="gpt", plans=plans, steps=3)  # real compute times every step


def test_compute_must_be_real_or_sleep() -> None:
    with pytest.raises(ValueError, match="--compute must be real or sleep"):
        HybridConfig(task="gpt", plans=(parse_plan("2x1x1"),), steps=2, compute="fast")


TINY = {"dim": 32, "layers": 2, "heads": 4, "seq_len": 16, "batch_size": 8, "vocab": 256,
        "max_bytes": 200_000, "eval_tokens": 512}  # fmt: skip


def test_a_stage_costs_what_its_parts_cost(tmp_path, monkeypatch) -> None:
    from thinwire.plan.block_profiles import compose_stage, profile_blocks
    from thinwire.plan.stage_profile import profile_plan

    monkeypatch.setenv("THINWIRE_CACHE", str(tmp_path))
    plan = parse_plan("2x2x2/mb2:powersgd(rank=2)")
    stages = profile_plan("gpt", TINY, plan, microbatch=2, repeats=1)
    parts = profile_blocks("gpt", TINY, plan, microbatch=2, repeats=1)
    assert len(parts.blocks) == 2 and parts.blocks[0] is parts.blocks[1]  # one kind of block
    for index, whole in enumerate(stages):
        composed = compose_stage(parts, range(index, index + 1), first=index == 0, last=index == 1)
        shapes = [torch.Size(s).numel() for s in whole.parameter_shapes]
        assert composed.parameter_bytes == 4 * sum(shapes)
        assert composed.saved_bytes == whole.saved_bytes
        assert composed.exchange_bytes == whole.exchange_bytes
        assert composed.optimizer_state_bytes == whole.optimizer_state_bytes
        assert sorted(composed.forward_allreduces) == sorted(
            c.nbytes for c in whole.forward.collectives
        )
        assert sorted(composed.backward_allreduces) == sorted(
            c.nbytes for c in (*whole.backward.collectives, *whole.loss_collectives)
        )
        assert composed.dp_cost.payload_bytes == whole.dp_cost.payload_bytes
        assert composed.activation_bytes == (whole.activation_bytes if index == 0 else 0)
    with pytest.raises(ValueError, match="at least one block"):
        compose_stage(parts, range(0), first=False, last=False)


def test_a_stage_profile_notes_the_shards_collectives_and_compute(tmp_path, monkeypatch) -> None:
    from thinwire.plan.stage_profile import profile_plan

    monkeypatch.setenv("THINWIRE_CACHE", str(tmp_path))
    plan = parse_plan("1x2x2/mb2")
    first, last = profile_plan("gpt", TINY, plan, microbatch=4, repeats=1)
    hidden = 4 * 16 * 32 * 4  # micro-batch x tokens x dim, fp32
    # the first stage: the vocabulary-parallel embedding's all-reduce, then one after
    # attention and one after the MLP; its backward reduces the input gradients of
    # query, key, value and the MLP's up projection (the embedding's input is tokens)
    assert [c.nbytes for c in first.forward.collectives] == [hidden] * 3
    assert [c.nbytes for c in first.backward.collectives] == [hidden] * 4
    assert first.output_shape == (4, 16, 32) and first.activation_bytes == hidden
    # the last stage: its block, and the head's input gradient; logits stay sharded
    assert [c.nbytes for c in last.forward.collectives] == [hidden] * 2
    assert [c.nbytes for c in last.backward.collectives] == [hidden] * 5
    assert last.output_shape == (4, 16, 128)
    assert len(last.loss_collectives) == 2 and not first.loss_collectives
    assert first.forward.compute_s > 0 and last.backward.compute_s > 0
    assert first.dp_sent_bytes == 0  # dp=1


def test_plans_of_one_shape_sleep_one_profile_each_with_its_own_exchange(monkeypatch) -> None:
    from types import SimpleNamespace

    from thinwire.bench import hybrid_sleep

    calls = []
    profile_plan = hybrid_sleep.profile_plan

    def counted(*args, **kwargs):
        calls.append(args[2])
        return profile_plan(*args, **kwargs)

    monkeypatch.setattr(hybrid_sleep, "profile_plan", counted)
    plans = [parse_plan(p) for p in ("2x1x1/mb2", "2x1x1/mb2:powersgd(rank=2)", "2x1x1/mb1")]
    config = SimpleNamespace(task="gpt", task_options=TINY, optimizer="adamw", plans=plans)
    shared: dict = {}
    dense, powersgd, fewer = (hybrid_sleep.profile(config, p, shared) for p in plans)
    assert [str(p) for p in calls] == [str(plans[0]), str(plans[2])]  # one per shape
    for a, b in zip(dense, powersgd, strict=True):
        assert a.forward == b.forward and a.backward == b.backward  # the same compute
        assert b.dp_cost.method == "powersgd" and a.dp_cost.method != "powersgd"
        assert b.dp_sent_bytes < a.dp_sent_bytes  # each its own method's exchange
        assert b.exchange_bytes > 0 == a.exchange_bytes  # PowerSGD keeps a residual
    assert fewer[0].forward != dense[0].forward  # another micro-batch size: its own


#: large enough that payloads outweigh gloo's per-message headers in the byte counts
SMALL = {**TINY, "dim": 64, "seq_len": 32}


@pytest.mark.multiprocess
@pytest.mark.skipif(check_can_emulate() is not None, reason=f"{check_can_emulate()}")
def test_sleeping_plans_send_what_the_model_and_the_real_step_send(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("THINWIRE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    code = main([
        "bench", "--task", "gpt", "--plans", "1x2x2/mb2 2x2x1/mb2", "--compute", "sleep",
        "--ranks-per-host", "2", "--bandwidth", "100mbit", "--latency", "1ms", "--steps", "3",
        "--untimed-steps", "1", "--task-options", json.dumps(SMALL), "--out", str(out),
        "--timeout", "300",
    ])  # fmt: skip
    assert code == 0
    record, data_parallel = json.loads((out / "results.json").read_text())["records"]
    assert (out / "throughput.png").exists()
    # each rank's exchange timed on every step, then alone outside the steps (dp=1: none)
    assert record["exchange_s_per_rank"] == [0.0] * 4
    assert record["exchange_alone_s_per_rank"] == [{}] * 4
    assert record["exchange_split_s_per_rank"] == [[0.0, 0.0]] * 4
    assert record["exchange_faults_per_rank"] == [0] * 4  # no exchange, nothing counted
    # whether a dense exchange takes fresh pages is the allocator's choice: only the
    # fields are checked here, the counts in test_step_phases.py
    assert len(data_parallel["exchange_faults_per_rank"]) == 4
    assert all(s > 0 for s in data_parallel["exchange_s_per_rank"])
    for alone in data_parallel["exchange_alone_s_per_rank"]:
        assert min(alone["together"], alone["by_stage"]) > 0
        assert 0 < alone["together_communicate"] <= alone["together"]
        assert {"together_faults", "by_stage_faults"} <= set(alone)
    for compress, communicate in data_parallel["exchange_split_s_per_rank"]:
        assert compress > 0 and communicate > 0  # the engine's own split of each step
    assert len(record["steps_s"]) == 3 and record["tokens_per_s"] > 0
    assert record["step_s"] == statistics.median(record["steps_s"][1:])  # after the untimed
    # every rank's last step: its computes, then its optimizer step (dp=1: no exchange)
    for timeline in record["timelines"]:
        kinds = [kind for _, kind, _, _ in timeline]
        assert "X" not in kinds and kinds.count("O") == 1
        (optimizer,) = [e for e in timeline if e[1] == "O"]
        assert optimizer[2] >= max(end for _, kind, _, end in timeline if kind in "FRB")
    # the two stages on separate hosts: activations and their gradients cross; tensor
    # parallelism stays inside each host. The model counts both (data-parallel traffic is
    # checked against it in the 25 M runs of docs/measurements.md)
    assert record["sent_between_hosts"] == pytest.approx(record["modelled_between_hosts"], rel=0.05)
    assert record["sent_within_host"] == pytest.approx(record["modelled_within_host"], rel=0.05)
    assert record["sent_between_hosts"] > 0 and record["sent_within_host"] > 0
    # each step sleeps at least the profiled compute of a stage's two micro-batches
    compute = max(s["forward"] + s["backward"] for s in record["stage_compute_s"])
    assert record["step_s"] > 2 * compute
    # a sleeping step sends what the real forward and backward pass sent (its second
    # step: the first also infers shapes): the replayed collectives are the real ones.
    # The counters are acknowledged bytes, read when a step ends: with the whole suite
    # loading both cores, acknowledgements straddle the step's edges by up to 1.2 %
    sleeping = record["sent_between_hosts"] + record["sent_within_host"]
    assert sleeping == pytest.approx(record["real_forward_backward_sent"], rel=0.02)
    # the planner's memory per rank, from the stage profiles and the simulated schedule,
    # against what each rank held (the same link figures as the cluster's; memory does
    # not depend on them)
    rows = predict_sweep(out / "results.json", _nominal_probe(), tmp_path / "profiles")["rows"]
    assert len(rows) == 2
    for row in rows:
        for stage in row["memory"]["stages"]:
            assert abs(stage["activations_error"]) < 0.05, (row["plan"], stage)
            assert abs(stage["total_error"]) < 0.15, (row["plan"], stage)
        assert row["predicted_s"] > 0


def _nominal_probe() -> LinkProbe:
    between, within = 8 / 100e6, 8 / 10e9
    return LinkProbe(
        hosts=2, ranks_per_host=2,
        point_to_point=(
            PointToPoint(1e-3, between, 1e5, 1), PointToPoint(1e-3, 2 * between, 1e5, 2),
        ),
        intra_allreduce={2: Fit(1e-4, within)},
        inter_allreduce={1: Fit(2e-3, between), 2: Fit(2e-3, 2 * between)},
        cpu_slowdown=1.0,
    )  # fmt: skip


def _hybrid_table():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "hybrid_table.py"
    spec = importlib.util.spec_from_file_location("hybrid_table", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(bandwidth: str, dense: float, best: float) -> dict:
    def record(plan: str, dp: int, pp: int, tokens: float) -> dict:
        return {"plan": plan, "degrees": {"dp": dp, "pp": pp, "tp": 1},
                "tokens_per_s": tokens, "sent_between_hosts": 2e6,
                "modelled_between_hosts": 1.9e6}  # fmt: skip

    return {
        "bandwidth": bandwidth,
        "records": [record("4x2x1/mb4/1f1b", 4, 2, best), record("8x1x1/mb1/1f1b", 8, 1, dense)],
    }


def test_the_bandwidth_table_compares_each_plan_with_dense_data_parallelism(tmp_path) -> None:
    module = _hybrid_table()
    runs = [_run("10mbit", 10.0, 80.0), _run("1gbit", 100.0, 150.0)]
    text = module.table(runs)
    assert "| 4x2x1/mb4/1f1b | 80 | 8.00 | 2.0 (1.9) | 150 | 1.50 | 2.0 (1.9) |" in text
    assert "| 8x1x1/mb1/1f1b | 10 | 1.00 |" in text
    module.plot(runs, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
    runs[1]["records"][0]["plan"] = "2x2x2/mb4/1f1b"
    with pytest.raises(SystemExit, match="same plans in the same order"):
        module.table(runs)
    without = {"bandwidth": "1gbit", "records": [runs[0]["records"][0]]}
    with pytest.raises(SystemExit, match="dense data-parallel plan"):
        module.speedups(without)
