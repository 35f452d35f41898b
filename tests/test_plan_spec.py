"""``thinwire bench --plans``: plans written on the command line, and hybrid plans trained
side by side on emulated hosts of several ranks."""

from __future__ import annotations

import json

import pytest

from thinwire.cli import main
from thinwire.cluster import check_can_emulate
from thinwire.parallel.plan_spec import parse_plan, parse_plans, plan_label

pytestmark = pytest.mark.timeout(600)

TINY = json.dumps(
    {"dim": 32, "layers": 2, "heads": 4, "seq_len": 16, "batch_size": 8, "vocab": 256,
     "max_bytes": 200_000, "eval_tokens": 512}
)  # fmt: skip


def test_plans_read_as_written_and_back() -> None:
    plan = parse_plan("2x2x2/mb4/gpipe:powersgd(rank=4)")
    assert (plan.dp, plan.pp, plan.tp, plan.microbatches, plan.schedule) == (2, 2, 2, 4, "gpipe")
    assert plan.dp_method == "powersgd" and plan.dp_options == {"rank": 4}
    assert plan_label(plan) == "2x2x2/mb4/gpipe:powersgd(rank=4)"
    assert parse_plan("1x4x2").microbatches == 4  # 1F1B's least
    assert [plan_label(p) for p in parse_plans("8x1x1; 4x2x1:dgc(density=0.01)")] == [
        "8x1x1/mb1/1f1b",
        "4x2x1/mb2/1f1b:dgc(density=0.01)",
    ]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("2x2", "write DPxPPxTP"),
        ("2x2x2/fast", "neither mbN"),
        ("2x2x2:powersgd(rank)", "not key=value"),
        ("2x2x2:zip", "unknown compressor 'zip'"),
    ],
)
def test_a_bad_plan_says_how_to_write_one(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_plan(spec)


def test_plans_of_different_world_sizes_are_refused(capsys, tmp_path) -> None:
    code = main(["bench", "--task", "gpt", "--plans", "2x1x1 4x1x1", "--out", str(tmp_path)])
    assert code == 2
    assert "different numbers of ranks" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.skipif(check_can_emulate() is not None, reason=f"{check_can_emulate()}")
def test_plans_train_side_by_side_on_hosts_of_several_ranks(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("THINWIRE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    code = main([
        "bench", "--task", "gpt", "--plans", "2x1x2:powersgd(rank=2) 1x2x2/mb2",
        "--ranks-per-host", "2", "--bandwidth", "100mbit", "--latency", "1ms",
        "--steps", "3", "--task-options", TINY, "--out", str(out), "--timeout", "300",
    ])  # fmt: skip
    assert code == 0
    records = json.loads((out / "results.json").read_text())["records"]
    assert [r["plan"] for r in records] == ["2x1x2/mb1/1f1b:powersgd(rank=2)", "1x2x2/mb2/1f1b"]
    assert all(0 < r["perplexity"] < 1000 and len(r["losses"]) == 3 for r in records)
    assert records[0]["dp_sent_bytes_per_step"] > 0  # dp=2 exchanged
    assert records[1]["dp_sent_bytes_per_step"] == 0  # dp=1: nothing to exchange
    assert (out / "losses.png").exists()
    for record in records:
        memory = record["memory_per_rank"]
        assert len(memory) == 4 and record["peak_memory_bytes"] == max(m["total"] for m in memory)
        assert all(m["parameters"] > 0 and m["activations"] > 0 for m in memory)
        assert all(m["gradients"] == m["parameters"] for m in memory)
        for m in memory:  # AdamW: two moments per parameter, and a step count per tensor
            assert 2 * m["parameters"] < m["optimizer"] < 2 * m["parameters"] + 1024
    assert all(m["exchange"] > 0 for m in records[0]["memory_per_rank"])  # PowerSGD's state
    assert all(m["exchange"] == 0 for m in records[1]["memory_per_rank"])
    # pipeline stages hold about half the parameters each; tensor parallel splits them again
    whole = sum(m["parameters"] for m in records[1]["memory_per_rank"])
    assert max(m["parameters"] for m in records[1]["memory_per_rank"]) < 0.4 * whole
