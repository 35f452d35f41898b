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
