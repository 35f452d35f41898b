"""``thinwire bench``: bad settings are refused before any worker starts; every method runs."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from thinwire.bench import runner
from thinwire.bench.methods import parse_methods
from thinwire.bench.runner import BenchConfig, run_bench
from thinwire.bench.sleeping import Stage
from thinwire.tasks import task

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


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
