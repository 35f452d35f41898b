"""``thinwire bench``: a short run writes complete, truthful records and a plot."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from thinwire.bench import runner
from thinwire.bench.link_probe import MODEL_PROBE_MAX_S, probe_numels, split_link_time
from thinwire.bench.methods import parse_methods
from thinwire.bench.runner import BenchConfig, run_bench
from thinwire.bench.sleeping import Stage
from thinwire.cluster import EmulatedCluster, check_can_emulate, list_namespaces
from thinwire.cluster.private import check_private_loopback
from thinwire.tasks import task

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

FIELDS = {
    "method",
    "options",
    "workers",
    "bandwidth",
    "latency",
    "steps",
    "wall_s",
    "step_s_median",
    "wall_step_s",
    "cpu_s_per_step",
    "compute_s_median",
    "comm_s_median",
    "bytes_sent_per_step",
    "compression_ratio",
    "final_train_loss",
    "eval_metric",
    "eval_value",
    "scaling_efficiency",
    "wall_scaling_efficiency",
    "loss_history",
    "time_history_s",
}


def _dense_ring_bytes(workers: int) -> float:
    """What one rank sends in a ring all-reduce of the digits MLP's fp32 gradients."""
    params = sum(p.numel() for p in task("digits").build_model().parameters())
    return 2 * (workers - 1) / workers * params * 4


def test_methods_are_validated_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="unknown method 'zip'"):
        parse_methods("dense,zip")
    with pytest.raises(ValueError, match="density must be in"):
        parse_methods("dgc", {"dgc": {"density": 2.0}})
    with pytest.raises(ValueError, match="not in --methods"):
        parse_methods("dense", {"dgc": {"density": 0.1}})
    methods = {m.name: m for m in parse_methods("powersgd,ddp-powersgd", {"powersgd": {"rank": 3}})}
    # the baseline runs at the same rank as thinwire's
    assert methods["ddp-powersgd"].options["matrix_approximation_rank"] == 3


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--momentum", "1.5"], "momentum must be in [0, 1), got 1.5"),
        (["--weight-decay", "-1"], "weight decay must be a number >= 0, got -1.0"),
        (["--measure-from", "-1"], "measure-from must be a step in 0 .. 1 (steps - 1), got -1"),
        (["--measure-from", "5"], "measure-from must be a step in 0 .. 1 (steps - 1), got 5"),
        (["--options", "{bad"], "--options is not valid JSON"),
        (["--repeats", "0"], "repeats must be an integer >= 1 (how many times the method list"),
        (["--task-options", "{bad"], "--task-options is not valid JSON"),
        (
            ["--task-options", '{"batch_size": "64"}'],
            "task 'digits': option batch_size must be an integer (default 32), got '64'",
        ),
        (
            ["--methods", "ps-sync", "--options", '{"ps-sync": {"servers": 5}}'],
            "ps-sync: 5 server(s) for 2 worker(s)",
        ),
        (["--methods", "dense", "--servers", "2"], "--methods lists neither"),
        (
            ["--methods", "dga", "--options", '{"dga": {"compressor": "topk", "lanes": 2}}'],
            "dga: lanes=2 runs several steps' exchanges at once, but compressor 'topk'",
        ),
    ],
)
def test_bad_bench_settings_are_refused_before_any_worker_starts(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Each once started the workers (or ran, or printed a bare parser message)."""
    from thinwire.cli import main

    base = ["bench", "--task", "digits", "--network", "loopback", "--workers", "2"]
    code = main([*base, "--steps", "2", "--out", str(tmp_path), *flags])
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert code == 2 and named in printed, printed
    assert not (tmp_path / "results.json").exists()


def test_a_bench_out_that_is_a_file_is_refused_with_what_to_do(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """It printed a bare "[Errno 17] File exists"."""
    from thinwire.cli import main

    target = tmp_path / "results"
    target.write_text("a file")
    base = ["bench", "--task", "digits", "--network", "loopback", "--workers", "2"]
    code = main([*base, "--steps", "2", "--out", str(target)])
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 2 and "is a file; give a directory" in printed, printed


def test_records_name_the_form_of_compressors_whose_defaults_depart_from_the_paper() -> None:
    methods = {m.name: m for m in parse_methods("dgc,terngrad,onebit,dga", steps=10)}
    assert methods["dgc"].options == {"masking": False, "warmup_steps": 1}
    assert methods["terngrad"].options == {"per_row": True}
    assert methods["onebit"].options == {"per_row": True}
    dga = {"compressor": "dgc", "compressor_options": {}, "lanes": 1}  # dgc runs in order
    wrapped = parse_methods("dga", {"dga": dga}, steps=30)  # carried DGC warms up alike
    assert wrapped[0].options["compressor_options"] == {"masking": False, "warmup_steps": 3}
    asked = parse_methods("dgc", {"dgc": {"masking": True}})  # the paper's form, on request
    assert asked[0].options["masking"] is True and asked[0].compressor().masking is True


def test_the_cosine_schedule_runs_from_lr_down_to_zero_and_names_are_checked() -> None:
    from thinwire.bench.worker import LR_SCHEDULES

    cosine = LR_SCHEDULES["cosine"]
    assert cosine(0, 100) == 1.0
    assert cosine(50, 100) == pytest.approx(0.5)
    assert cosine(100, 100) == pytest.approx(0.0, abs=1e-12)
    assert all(cosine(t, 100) > cosine(t + 1, 100) for t in range(100))
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'step'"):
        BenchConfig(task="digits", methods=parse_methods("dense"), lr_schedule="step")


def test_the_uplink_queue_is_checked_before_any_process_starts() -> None:
    config = BenchConfig(task="digits", methods=parse_methods("dense"), uplink_queue=256)
    assert config.uplink_queue == 256
    with pytest.raises(ValueError, match="uplink queue is a number of packets from 2"):
        BenchConfig(task="digits", methods=parse_methods("dense"), uplink_queue=1)


def test_delayed_averaging_and_parameter_servers_run_in_the_bench(tmp_path: Path) -> None:
    config = BenchConfig(
        task="digits",
        methods=parse_methods("dense,ps-sync,dga,ps-async", {"dga": {"delay": 2}}, steps=6),
        workers=2,
        steps=6,
        lr=0.1,
        network="loopback",
    )
    by = {r["method"]: r for r in run_bench(config, tmp_path)}
    # the synchronous server makes the same updates as DDP's all-reduce
    assert by["ps-sync"]["loss_history"] == pytest.approx(by["dense"]["loss_history"], rel=1e-5)
    assert by["ps-sync"]["eval_value"] == by["dense"]["eval_value"]
    # delayed and stale updates differ from synchronous ones after the first steps
    for method in ("dga", "ps-async"):
        assert by[method]["loss_history"][0] == pytest.approx(by["dense"]["loss_history"][0])
        assert by[method]["loss_history"][-1] != pytest.approx(by["dense"]["loss_history"][-1])
        assert by[method]["bytes_sent_per_step"] > 0
    # fp32 gradients all-reduced late are as many bytes as DDP's: the exchanges still in
    # flight when the count begins are counted as exchanges too. Those (at most `delay` of
    # them) may have sent some or all of their bytes before the count began, more so on a
    # busy machine: per step, between counted / (counted + delay) of DDP's bytes and DDP's.
    counted = config.steps - by["dga"]["measured_from_step"]
    dense_bytes = by["dense"]["bytes_sent_per_step"]
    lowest = dense_bytes * counted / (counted + by["dga"]["options"]["delay"])
    assert 0.95 * lowest <= by["dga"]["bytes_sent_per_step"] <= 1.1 * dense_bytes, (
        by["dga"]["bytes_sent_per_step"],
        dense_bytes,
        counted,
    )
    assert by["dga"]["options"] == {
        "delay": 2,
        "lanes": 2,
        "compressor": "none",
        "compressor_options": {},
    }
    with pytest.raises(ValueError, match="dga: lanes must be an integer >= 1"):
        parse_methods("dga", {"dga": {"lanes": 0}})
    with pytest.raises(ValueError, match="ps-async: momentum must be in"):
        parse_methods("ps-async", {"ps-async": {"momentum": 1.5}})


def test_local_sgd_and_diloco_run_in_the_bench(tmp_path: Path) -> None:
    options = {"local-sgd": {"sync_every": 1}, "diloco": {"sync_every": 3}}
    config = BenchConfig(
        task="digits",
        methods=parse_methods("dense,local-sgd,diloco", options, steps=6),
        workers=2,
        steps=6,
        lr=0.1,
        network="loopback",
        measure_from=0,
    )
    by = {r["method"]: r for r in run_bench(config, tmp_path)}
    # weights averaged after every step of SGD with momentum: DDP's updates (SGD is linear
    # in the gradient and its momentum buffer)
    assert by["local-sgd"]["loss_history"] == pytest.approx(by["dense"]["loss_history"], rel=1e-4)
    # fp32 weights every third step: a third of DDP's bytes
    assert by["diloco"]["bytes_sent_per_step"] == pytest.approx(
        by["dense"]["bytes_sent_per_step"] / 3, rel=0.15
    )
    assert by["diloco"]["options"]["outer_lr"] == 0.7
    assert by["diloco"]["loss_history"][-1] != pytest.approx(by["dense"]["loss_history"][-1])


def test_sparse_embedding_methods_train_as_dense_ddp_with_far_fewer_bytes(
    tmp_path: Path,
) -> None:
    config = BenchConfig(
        task="packages",
        task_options={"vocab_size": 4096, "batch_size": 8},
        methods=parse_methods("dense,emb-allgather,emb-sharded"),
        workers=2,
        steps=4,
        lr=1.0,
        network="loopback",
    )
    by = {r["method"]: r for r in run_bench(config, tmp_path)}
    for method in ("emb-allgather", "emb-sharded"):
        # the same updates as DDP's dense all-reduce, and the same model at the end
        assert by[method]["loss_history"] == pytest.approx(by["dense"]["loss_history"], rel=1e-5)
        assert by[method]["eval_value"] == pytest.approx(by["dense"]["eval_value"], abs=2e-3)
        # 8 snippets of 64 words touch a few hundred of 4096 rows: far fewer bytes
        assert by[method]["bytes_sent_per_step"] < by["dense"]["bytes_sent_per_step"] / 4
    assert by["emb-sharded"]["options"] == {
        "overlap": True,
        "prefetch": True,
        "compressor": "none",
        "compressor_options": {},
    }


def test_the_dense_part_of_a_sparse_embedding_model_can_go_through_a_compressor(
    tmp_path: Path,
) -> None:
    config = BenchConfig(
        task="packages",
        task_options={"vocab_size": 4096, "batch_size": 8},
        methods=parse_methods(
            "emb-sharded,emb-allgather",
            {"emb-sharded": {"compressor": "fp16"}, "emb-allgather": {"compressor": "none"}},
        ),
        workers=2,
        steps=4,
        lr=1.0,
        network="loopback",
    )
    by = {r["method"]: r for r in run_bench(config, tmp_path)}
    engine = by["emb-sharded"]["thinwire"]
    assert engine is not None and engine["compression_ratio_median"] == pytest.approx(2.0)
    assert by["emb-allgather"]["thinwire"] is None  # DDP's own all-reduce
    # fp16 rounding of the head's gradients changes the losses only a little
    assert by["emb-sharded"]["loss_history"] == pytest.approx(
        by["emb-allgather"]["loss_history"], rel=1e-3
    )


def test_sparse_embedding_methods_refuse_what_they_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="prefetch needs overlap"):
        parse_methods("emb-sharded", {"emb-sharded": {"overlap": False}})
    with pytest.raises(ValueError, match="applies momentum itself"):
        parse_methods("emb-allgather", {"emb-allgather": {"compressor": "dgc"}})
    with pytest.raises(ValueError, match="overlap must be true or false"):
        parse_methods("emb-sharded", {"emb-sharded": {"overlap": "yes", "prefetch": False}})
    config = BenchConfig(
        task="digits", methods=parse_methods("emb-sharded"), workers=2, steps=2, network="loopback"
    )
    with pytest.raises(RuntimeError, match=r"needs a model with nn\.Embedding layers"):
        run_bench(config, tmp_path)


def test_a_short_loopback_run_writes_every_field(tmp_path: Path) -> None:
    config = BenchConfig(
        task="digits",
        methods=parse_methods("local,dense,dgc", steps=4),
        workers=2,
        steps=4,
        lr=0.1,
        network="loopback",
    )
    records = run_bench(config, tmp_path)
    written = json.loads((tmp_path / "results.json").read_text())
    assert [r["method"] for r in written] == ["local", "dense", "dgc"]
    for record in written:
        assert set(record) >= FIELDS, FIELDS - set(record)
        assert len(record["loss_history"]) == 4
        # wall-clock per measured step: between the last two end times of the slowest rank
        ends = record["time_history_s"]
        measured = 4 - record["measured_from_step"]
        assert record["wall_step_s"] == pytest.approx(
            (ends[-1] - ends[record["measured_from_step"] - 1]) / measured
        )
        assert 0.0 <= record["eval_value"] <= 1.0 and record["eval_metric"] == "accuracy"
    by = {r["method"]: r for r in records}
    assert by["local"]["scaling_efficiency"] == pytest.approx(1.0)
    for record in records:
        assert record["wall_scaling_efficiency"] == pytest.approx(
            by["local"]["wall_step_s"] / record["wall_step_s"]
        )
    # dense moves at least the ring all-reduce volume (without root, loopback is shared
    # with anything else on this machine, so only a lower bound holds); DGC (density 0.001
    # on 2-D tensors, 1-D tensors dense) contributes far less, by the engine's own count
    assert by["dense"]["loopback_private"] is (check_private_loopback() is None)
    assert by["dense"]["bytes_sent_per_step"] >= 0.95 * _dense_ring_bytes(2)
    assert by["dgc"]["thinwire"]["payload_bytes_median"] < _dense_ring_bytes(2) / 5


@pytest.mark.skipif(check_private_loopback() is not None, reason="private loopback needs root")
def test_a_loopback_run_counts_its_own_bytes_while_the_machine_sends_others(
    tmp_path: Path,
) -> None:
    config = BenchConfig(
        task="digits", methods=parse_methods("dense"), workers=2, steps=6, network="loopback"
    )
    stop = threading.Event()
    blasted = []

    def blast() -> None:  # megabytes over the machine's 127.0.0.1 all through the run
        with socket.create_server(("127.0.0.1", 0)) as server:
            sink = threading.Thread(target=lambda: _drain(server))
            sink.start()
            with socket.create_connection(server.getsockname()) as client:
                while not stop.is_set():
                    client.sendall(b"z" * (1 << 20))
                    blasted.append(1 << 20)
                    time.sleep(0.005)
            sink.join()

    blaster = threading.Thread(target=blast)
    blaster.start()
    try:
        (record,) = run_bench(config, tmp_path)
    finally:
        stop.set()
        blaster.join()
    assert sum(blasted) > 20 * _dense_ring_bytes(2)  # far more than the run's own bytes
    assert record["loopback_private"] is True
    assert record["bytes_sent_per_step"] == pytest.approx(_dense_ring_bytes(2), rel=0.1)


def test_a_loopback_run_falls_back_to_the_machines_own_when_it_cannot_make_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import contextlib

    import thinwire.bench.runner as runner

    @contextlib.contextmanager
    def refused():
        raise RuntimeError("unshare: Operation not permitted")
        yield  # pragma: no cover

    monkeypatch.setattr(runner, "check_private_loopback", lambda: None)
    monkeypatch.setattr(runner, "private_loopback", refused)
    config = BenchConfig(
        task="digits", methods=parse_methods("dense"), workers=2, steps=2, network="loopback"
    )
    (record,) = run_bench(config, tmp_path)
    assert record["loopback_private"] is False
    assert record["bytes_sent_per_step"] >= 0.95 * _dense_ring_bytes(2)


def _drain(server: socket.socket) -> None:
    peer, _ = server.accept()
    with peer:
        while peer.recv(1 << 20):
            pass


def _ddp_broadcasts(rank: int, world_size: int, broadcast: bool) -> dict[str, Any]:
    """Whether each DDP-based method's model broadcasts buffers, as the bench builds it."""
    import warnings

    import torch

    from thinwire.bench.methods import wrap

    found: dict[str, Any] = {}
    for method in parse_methods("dense,ddp-fp16,ddp-powersgd,powersgd"):
        model = task("fashion", width=4).build_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped = wrap(method, model, optimizer, broadcast_buffers=broadcast)
        found[method.name] = wrapped.model.broadcast_buffers
        found["warned"] = [str(w.message) for w in caught if "buffers" in str(w.message)]
        if wrapped.engine is not None:
            wrapped.engine.close()
    return found


@pytest.mark.parametrize("broadcast", [True, False])
def test_ddp_methods_broadcast_buffers_only_when_asked(broadcast: bool) -> None:
    from thinwire.launch import run_local

    for found in run_local(_ddp_broadcasts, 2, (broadcast,), timeout=120):
        assert found.pop("warned") == []  # no deprecated option passed (torch 2.13 renamed it)
        assert found == dict.fromkeys(("dense", "ddp-fp16", "ddp-powersgd", "powersgd"), broadcast)


def test_sleeping_compute_runs_the_methods_on_the_measured_stage_times(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"compute must be one of \('real', 'sleep'\), got 'gpu'"):
        BenchConfig(task="digits", methods=parse_methods("dense"), compute="gpu")
    with pytest.raises(ValueError, match=r"\['emb-sharded'\] replace its embeddings"):
        BenchConfig(task="packages", methods=parse_methods("emb-sharded"), compute="sleep")
    config = BenchConfig(
        task="fashion",
        task_options={"batch_size": 4, "width": 8},
        methods=parse_methods("local,powersgd", steps=3),
        workers=2,
        steps=3,
        network="loopback",
        compute="sleep",
    )
    records = run_bench(config, tmp_path)
    for record in records:
        slept = record["slept_forward_s"] + record["slept_backward_s"]
        assert slept > 0
        assert record["step_s_median"] >= slept  # every step sleeps at least that long
        # ... and a sleep uses no CPU: the process's CPU time is below the step's
        assert 0 < record["cpu_s_per_step"] < record["step_s_median"]
        assert record["eval_value"] is None  # the twin's weights learn nothing: no metric
        assert record["config"]["compute"] == "sleep"
        # the twin returns zeros: cross-entropy over 10 classes, whatever the weights
        assert record["final_train_loss"] == pytest.approx(2.302585, abs=1e-5)
    assert records[1]["thinwire"]["payload_bytes_median"] > 0  # powersgd exchanged


def test_a_compute_speedup_divides_the_sleeps_and_needs_sleeping_compute() -> None:
    class TwoRanks:
        """Two ranks' measurements of one stage, as a pool would return them."""

        def run(self, fn: Any, *args: Any, timeout: float) -> list[list[Stage]]:
            return [[Stage("body", 0.2, 0.4)], [Stage("body", 0.4, 0.8)]]

    dense = parse_methods("dense")
    config = BenchConfig(task="digits", methods=dense, compute="sleep", compute_speedup=10)
    console = Console(file=io.StringIO())
    (stage,) = runner._measure_stages(TwoRanks(), config, console)  # type: ignore[arg-type]
    assert (stage.forward_s, stage.backward_s) == pytest.approx((0.03, 0.06))  # mean / 10
    assert "10x faster than this CPU" in console.file.getvalue()
    for bad in (0, -2.0, float("nan"), "fast"):
        with pytest.raises(ValueError, match="--compute-speedup must be a number > 0"):
            BenchConfig(task="digits", methods=dense, compute="sleep", compute_speedup=bad)
    with pytest.raises(ValueError, match="add --compute sleep or drop the speed-up"):
        BenchConfig(task="digits", methods=dense, compute_speedup=50)
    thinwire = [sys.executable, "-m", "thinwire.cli", "bench"]
    plans = subprocess.run(
        [*thinwire, "--plans", "2x1x1", "--compute", "sleep", "--compute-speedup", "5"],
        capture_output=True,
        text=True,
    )
    assert plans.returncode == 2 and "drop --compute-speedup" in plans.stdout


@pytest.mark.skipif(check_can_emulate() is not None, reason=f"{check_can_emulate()}")
def test_a_short_emulated_run_counts_real_wire_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[EmulatedCluster] = []

    class RecordedCluster(EmulatedCluster):
        """The runner's cluster, remembered: other tests may bring up clusters meanwhile."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(runner, "EmulatedCluster", RecordedCluster)
    config = BenchConfig(
        task="digits",
        methods=parse_methods("local,dense"),
        workers=2,
        steps=3,
        bandwidth="50mbit",
        latency="1ms",
        lr=0.1,
        network="emulated",
    )
    records = {r["method"]: r for r in run_bench(config, tmp_path)}
    ring = _dense_ring_bytes(2)
    # the kernel's counters include TCP/IP headers and acknowledgements, nothing else
    assert ring <= records["dense"]["bytes_sent_per_step"] < 1.25 * ring
    assert records["local"]["bytes_sent_per_step"] < 0.01 * ring
    assert records["dense"]["allreduce_bandwidth_bps"] > 0  # the link was probed
    # with the ring's fixed cost taken out, the probes see about the configured 50 Mbit/s:
    # a limiter off by a unit (bits for bytes, a factor of 10) fails this. The figure
    # itself is a benchmark's (docs/measurements.md); on a loaded 2-core machine the probes
    # have seen 34 Mbit/s, so the bounds here only catch a limiter that is wrong.
    assert 0.6 * 50e6 <= records["dense"]["allreduce_link_bps"] <= 1.25 * 50e6
    # a few ms of latency per all-reduce, give or take the fit's noise (0.14 s was seen on
    # a loaded 2-core machine); not seconds
    assert abs(records["dense"]["allreduce_fixed_s"]) < 0.5
    assert built  # the run's clusters (one per method) are gone again
    assert not {h.namespace for c in built for h in c.hosts} & set(list_namespaces())
    assert (tmp_path / "results.json").exists()


def test_the_model_probe_is_capped_on_slow_links() -> None:
    share = 1.5  # four ranks' ring: each link carries 1.5 times the payload
    # 2.8 M parameters at 1 gbit/s: the model's own all-reduce (0.13 s of link time)
    model, small, big = probe_numels(2_800_000, share, 1e9)
    assert model == 2_800_000 and small < big
    # at 100 kbit/s it would take 1,344 s; the probe stops at MODEL_PROBE_MAX_S of link
    capped, *_ = probe_numels(2_800_000, share, 1e5)
    assert capped * 4 * share * 8 / 1e5 == pytest.approx(MODEL_PROBE_MAX_S, rel=1e-3)
    assert probe_numels(2_800_000, share, None) == [2_800_000]  # unlimited: no fit either


def test_split_link_time_recovers_bandwidth_and_fixed_cost() -> None:
    def seconds(wire: float) -> float:
        return 0.012 + wire * 8 / 1e9

    bandwidth, fixed = split_link_time(16.8e6, seconds(16.8e6), 140e6, seconds(140e6))
    assert bandwidth == pytest.approx(1e9) and fixed == pytest.approx(0.012)
    assert split_link_time(16.8e6, 0.2, 140e6, 0.2) == (None, None)  # no slope: no fit
    assert split_link_time(16.8e6, 0.2, 16.8e6, 0.3) == (None, None)


def test_command_line_rejects_bad_input_and_writes_the_plot(tmp_path: Path) -> None:
    thinwire = [sys.executable, "-m", "thinwire.cli", "bench"]
    bad = subprocess.run([*thinwire, "--methods", "dense,nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown method 'nope'" in bad.stdout
    shards = subprocess.run(
        [*thinwire, "--methods", "dense,ps-sync", "--servers", "0"], capture_output=True, text=True
    )
    assert shards.returncode == 2 and "ps-sync: servers must be an integer >= 1" in shards.stdout
    ok = subprocess.run(
        [
            *thinwire,
            "--task",
            "digits",
            "--workers",
            "2",
            "--network",
            "loopback",
            "--steps",
            "2",
            "--methods",
            "local,dense",
            "--repeats",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert "dense #2" in ok.stdout and "over 2 repeats" in ok.stdout
    written = json.loads((tmp_path / "results.json").read_text())
    # the second repeat runs the list backwards, so drift weighs on both methods alike
    assert [(r["method"], r["repeat"]) for r in written] == [
        ("local", 1),
        ("dense", 1),
        ("dense", 2),
        ("local", 2),
    ]
    summary = {e["method"]: e for e in json.loads((tmp_path / "repeats.json").read_text())}
    dense = [r for r in written if r["method"] == "dense"]
    assert summary["dense"]["repeats"] == 2
    assert summary["dense"]["step_s_median"]["values"] == [r["step_s_median"] for r in dense]
    assert summary["dense"]["scaling_efficiency"]["median"] == pytest.approx(
        sum(r["scaling_efficiency"] for r in dense) / 2
    )


def _timed(method: str, repeat: int, step_s: float) -> dict[str, Any]:
    """A record with just what the ratios need."""
    return {
        "method": method,
        "repeat": repeat,
        "options": {},
        "step_s_median": step_s,
        "wall_step_s": step_s,
        "bytes_sent_per_step": 0.0 if method == "local" else 1e6,
        "thinwire": None,
    }


def test_each_repeat_is_measured_against_its_own_local_and_dense() -> None:
    from thinwire.bench.ratios import add_ratios
    from thinwire.bench.repeats import repeat_order, summarise_repeats

    assert repeat_order("abc", 1) == ["a", "b", "c"] == repeat_order("abc", 3)
    assert repeat_order("abc", 2) == ["c", "b", "a"]
    # the machine ran twice as slow in the second repeat: every ratio stays the same
    records = [
        _timed("local", 1, 1.0),
        _timed("dense", 1, 4.0),
        _timed("dgc", 1, 1.25),
        _timed("dgc", 2, 2.5),
        _timed("dense", 2, 8.0),
        _timed("local", 2, 2.0),
        _timed("local", 3, 1.0),
        _timed("dense", 3, 4.0),
        _timed("dgc", 3, 1.0),
    ]
    add_ratios(records)
    dgc = [r for r in records if r["method"] == "dgc"]
    assert [r["scaling_efficiency"] for r in dgc] == [0.8, 0.8, 1.0]
    assert [r["throughput_vs_dense"] for r in dgc] == [3.2, 3.2, 4.0]
    assert [r["compute_s_median"] for r in dgc] == [1.0, 2.0, 1.0]
    summary = {e["method"]: e for e in summarise_repeats(records)}
    assert list(summary) == ["local", "dense", "dgc"]
    assert summary["dgc"]["scaling_efficiency"] == {
        "median": 0.8,
        "min": 0.8,
        "max": 1.0,
        "values": [0.8, 0.8, 1.0],
    }
    assert summary["dgc"]["step_s_median"]["values"] == [1.25, 2.5, 1.0]
    assert summary["local"]["repeats"] == 3


def test_the_plot_of_a_repeated_run_shows_the_spread(tmp_path: Path) -> None:
    from thinwire.bench.repeats import summarise_repeats
    from thinwire.bench.report import plot, repeats_table

    records = [_timed("local", 1, 1.0), _timed("dgc", 1, 1.25), _timed("dgc", 2, 2.5)]
    for r in records:
        r.update(loss_history=[2.0, 1.5], time_history_s=[1.0, 2.0], steps=2)
        r.update(task="digits", workers=2, network="loopback", measured_from_step=1)
    assert plot(records, tmp_path / "plot.png").stat().st_size > 10_000
    table = repeats_table(summarise_repeats(records), 2)
    assert table.row_count == 2 and "over 2 repeats" in str(table.title)


@pytest.mark.skipif(check_can_emulate() is not None, reason=f"{check_can_emulate()}")
def test_collectives_benchmark_times_the_four_kinds_on_the_cluster(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "bench" / "collectives.py"
    out = tmp_path / "collectives.json"
    done = subprocess.run(
        [sys.executable, str(script), "--hosts", "2", "--bandwidth", "100mbit", "--latency",
         "20ms", "--sizes", "4000", "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seconds = json.loads(out.read_text())["seconds"]["4000"]
    assert set(seconds) == {"all_reduce", "all_gather", "all_to_all", "broadcast"}
    # 2 hosts: all-reduce 2 ring steps, the others 1; each step waits at least 2 x 20 ms
    assert seconds["all_to_all"] >= 0.04 and seconds["all_reduce"] >= 0.08
    # the payload crosses the link, then the one-element all-reduce's answer comes back
    assert seconds["broadcast"] >= 0.04
    assert seconds["all_to_all"] < seconds["all_reduce"]
    bad = subprocess.run(
        [sys.executable, str(script), "--sizes", "x"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--sizes must be integers" in bad.stderr


def test_method_label_names_a_chosen_communicator() -> None:
    from thinwire.bench.report import method_label

    assert method_label({"method": "powersgd", "options": {"rank": 2}}) == "powersgd"
    assert method_label({"method": "dgc", "options": {"communicator": "auto"}}) == "dgc"
    direct = {"method": "powersgd", "options": {"rank": 2, "communicator": "direct"}}
    assert method_label(direct) == "powersgd (direct)"


def test_a_method_faster_than_local_makes_the_run_suspect() -> None:
    from thinwire.bench.report import timing_warnings

    def record(method: str, step: float, wall: float) -> dict:
        return {"method": method, "scaling_efficiency": step, "wall_scaling_efficiency": wall}

    calm = [record("local", 1.0, 1.0), record("dgc", 0.97, 0.96), record("dga", 0.8, 1.08)]
    assert timing_warnings(calm) == []
    busy = [record("local", 1.0, 1.0), record("dgc", 1.31, 1.2), record("dga", 0.9, 1.4)]
    (warning,) = timing_warnings(busy)
    assert "dgc 1.31x" in warning and "dga 1.40x" in warning and "again" in warning


def test_repredict_script_predicts_a_finished_run_again(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "bench" / "repredict.py"
    config = {
        "task": "digits",
        "workers": 4,
        "bandwidth": "10mbit",
        "latency": "1ms",
        "steps": 4,
        "network": "emulated",
        "task_options": {},
        "bucket_cap_mb": None,
    }
    records = [
        {"method": "local", "options": {}, "step_s_median": 0.01, "config": config},
        {"method": "dense", "options": {}, "step_s_median": 0.2, "config": config},
    ]

    def repredict(name: str, written: list[dict], *flags: str) -> tuple[Path, Any]:
        path = tmp_path / name
        path.write_text(json.dumps(written))
        command = [sys.executable, str(script), str(path), *flags]
        return path, subprocess.run(command, capture_output=True, text=True)

    results, run = repredict("results.json", records, "--write")
    assert run.returncode == 0, run.stderr
    assert "dense" in run.stdout and "measured 0.200 s" in run.stdout
    dense = json.loads(results.read_text())[1]["predicted"]
    assert dense["error"] == pytest.approx(dense["step_s"] / 0.2 - 1)
    # the digits MLP's 0.4 MB all-reduced over 10 Mbit/s links takes ~0.5 s
    assert 0.3 < dense["step_s"] < 1.0
    # a repeated run: each repeat predicted with its own local step, named by its repeat
    again = [{**r, "repeat": 1} for r in records] + [
        {**records[1], "repeat": 2, "step_s_median": 0.3},
        {**records[0], "repeat": 2, "step_s_median": 0.05},
    ]
    repeated, run = repredict("repeated.json", again, "--write")
    assert run.returncode == 0, run.stderr
    assert "dense #2" in run.stdout and "measured 0.300 s" in run.stdout
    first, second = (
        r["predicted"] for r in json.loads(repeated.read_text()) if r["method"] == "dense"
    )
    assert second["step_s"] > first["step_s"]  # 40 ms more compute in repeat 2
    _, bad = repredict(
        "loopback.json", [{**records[0], "config": {**config, "network": "loopback"}}]
    )
    assert bad.returncode == 1 and "a loopback run has no link to predict for" in bad.stderr


def test_unsynchronised_methods_are_timed_by_the_wall_clock() -> None:
    from thinwire.bench.ratios import throughput_step_s

    timings = {"step_s_median": 1.0, "wall_step_s": 0.9}
    assert throughput_step_s({"method": "dense", **timings}) == 1.0
    assert throughput_step_s({"method": "powersgd", **timings}) == 1.0
    assert throughput_step_s({"method": "ps-sync", **timings}) == 1.0
    assert throughput_step_s({"method": "dga", **timings}) == 0.9
    assert throughput_step_s({"method": "ps-async", **timings}) == 0.9


def test_sleeping_ranks_calibrate_compression_by_their_cpu_not_the_sleeps() -> None:
    from thinwire.plan.cost import ComputeTime

    profiled = ComputeTime(forward_s=0.01, backward_s=0.03, optimizer_s=0.005)
    record = {"slept_forward_s": 0.002, "slept_backward_s": 0.006}
    sleeping = BenchConfig(
        task="digits", methods=parse_methods("dgc"), compute="sleep", compute_speedup=50
    )
    # the ranks measured 0.008 x 50 = 0.4 s of forward and backward against 0.04 s here
    assert runner.sleeping_cpu_scale(sleeping, record, profiled) == pytest.approx(10.0)
    assert runner.sleeping_cpu_scale(sleeping, {}, profiled) is None
    real = BenchConfig(task="digits", methods=parse_methods("dgc"))
    assert runner.sleeping_cpu_scale(real, record, profiled) is None


def test_a_failed_plans_error_prints_as_it_is_not_as_markup() -> None:
    """gloo's messages quote ``[file:line]``, which rich reads as a closing tag: printed as
    markup it raised and ended the sweep, losing the plans after the failed one."""
    from thinwire.bench.command import plain_printer

    message = "  2x1x4/mb1 failed: [/__w/gloo/transport/tcp/unbound_buffer.cc:78] Timed out"
    console = Console(file=io.StringIO(), width=200)
    plain_printer(console)(message)
    assert console.file.getvalue().strip() == message.strip()
    with pytest.raises(Exception, match="closing tag"):
        Console(file=io.StringIO(), width=200).print(message)
