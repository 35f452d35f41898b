"""``thinwire bench --plans``: a plan that fails is recorded and the sweep goes on; failures
in a row stop it with an error that says where to look; a plan whose batch does not split
is refused before any rank starts."""

from __future__ import annotations

import json

import pytest

import thinwire.bench.hybrid as hybrid
from thinwire.cli import main

pytestmark = [pytest.mark.timeout(600), pytest.mark.multiprocess]

TINY = json.dumps(
    {"dim": 32, "layers": 2, "heads": 4, "seq_len": 16, "batch_size": 8, "vocab": 256,
     "max_bytes": 200_000, "eval_tokens": 512}
)  # fmt: skip


def _bench(plans: str, out, capsys) -> tuple[int, str]:
    code = main([
        "bench", "--task", "gpt", "--plans", plans, "--steps", "2", "--task-options", TINY,
        "--out", str(out), "--timeout", "300",
    ])  # fmt: skip
    return code, " ".join(capsys.readouterr().out.split())


def _failing(labels: set[str], monkeypatch) -> None:
    """Plans in ``labels`` fail as a rank's error does (pool.run's RuntimeError); the others
    run for real."""
    run_one_plan = hybrid.run_one_plan

    def run_or_fail(config, plan, *args, **kwargs):
        if hybrid.plan_label(plan) in labels:
            raise RuntimeError(f"rank 1 failed in train_plan: {hybrid.plan_label(plan)} broke")
        return run_one_plan(config, plan, *args, **kwargs)

    monkeypatch.setattr(hybrid, "run_one_plan", run_or_fail)


def test_a_failing_plan_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("THINWIRE_CACHE", str(tmp_path / "cache"))
    _failing({"2x1x1/mb2/1f1b"}, monkeypatch)
    code, printed = _bench("2x1x1/mb2 2x1x1", tmp_path / "out", capsys)
    assert code == 1
    assert "1 of 2 plans failed" in printed and "2x1x1/mb2/1f1b broke" in printed
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["plan"] for r in results["records"]] == ["2x1x1/mb1/1f1b"]
    assert 0 < results["records"][0]["perplexity"] < 1000
    assert results["failed"] == [
        {"plan": "2x1x1/mb2/1f1b", "error": "rank 1 failed in train_plan: 2x1x1/mb2/1f1b broke"}
    ]
    assert (tmp_path / "out" / "losses.png").exists()


def test_failures_in_a_row_stop_the_sweep(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("THINWIRE_CACHE", str(tmp_path / "cache"))
    failing = ["2x1x1/mb1/1f1b", "2x1x1/mb2/1f1b", "2x1x1/mb4/1f1b", "2x1x1/mb4/gpipe"]
    failing = failing[: hybrid.FAILURES_IN_A_ROW]
    _failing(set(failing), monkeypatch)
    code, printed = _bench(" ".join([*failing, "2x1x1/mb2/gpipe"]), tmp_path / "out", capsys)
    assert code == 1
    assert f"{hybrid.FAILURES_IN_A_ROW} plans failed in a row" in printed
    assert "the sweep stopped" in printed
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["records"] == []  # the plan after them never ran
    assert [f["plan"] for f in results["failed"]] == failing


def test_a_plan_whose_batch_does_not_split_is_refused_before_the_sweep(tmp_path, capsys) -> None:
    code, printed = _bench("2x1x1 2x1x1/mb8", tmp_path / "out", capsys)
    assert code == 2
    assert "plan 2x1x1/mb8/1f1b" in printed and "does not split evenly" in printed
    assert not (tmp_path / "out").exists()  # nothing started
