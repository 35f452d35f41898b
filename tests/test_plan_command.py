"""``thinwire plan``: its report and JSON, and the input and plans it refuses."""

from __future__ import annotations

import json
import math

import pytest

from thinwire.cli import main

pytestmark = [pytest.mark.timeout(120)]

# -- the command ----------------------------------------------------------------------------


def test_plan_command_on_digits(tmp_path, capsys) -> None:
    try:
        from thinwire.tasks import task  # noqa: F401
    except ImportError as error:
        pytest.skip(f"thinwire.tasks.task is not importable yet: {error}")
    out = tmp_path / "plan.json"
    argv = [
        "plan",
        "--task",
        "digits",
        "--workers",
        "4",
        "--bandwidth",
        "10mbit",
        "--latency",
        "1ms",
        "--methods",
        "local,dense,dgc",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for text in ("thinwire plan: digits, 4 workers, 10 Mbit/s", "dense", "dgc", "beats dense"):
        assert text in printed
    data = json.loads(out.read_text())
    rows = {m["method"]: m for m in data["methods"]}
    assert set(rows) == {"local", "dense", "dgc"}
    assert rows["local"]["efficiency"] == 1.0 and rows["local"]["compression_ratio"] is None
    assert rows["dgc"]["step_s"] < rows["dense"]["step_s"]
    assert rows["dgc"]["payload_bytes"] < rows["dense"]["payload_bytes"] / 50
    assert math.isclose(data["bandwidth_bps"], 10e6)


def test_plan_command_models_ddps_buckets_and_buffer_broadcast(tmp_path, capsys) -> None:
    base = ["plan", "--task", "fashion", "--workers", "4", "--bandwidth", "10mbit"]
    base += ["--latency", "1ms", "--task-options", '{"batch_size": 8, "width": 8}']
    runs = {}
    for name, extra in {
        "default": [],
        "quiet": ["--no-broadcast-buffers"],
        "small": ["--bucket-cap-mb", "0.5", "--no-broadcast-buffers"],
    }.items():
        out = tmp_path / f"{name}.json"
        assert main([*base, "--methods", "dense", *extra, "--json", str(out)]) == 0
        runs[name] = json.loads(out.read_text())
    capsys.readouterr()
    assert runs["default"]["broadcast_buffers"] is True
    assert runs["quiet"]["broadcast_buffers"] is False
    assert runs["small"]["bucket_cap_mb"] == 0.5
    assert runs["default"]["task_options"] == {"batch_size": 8, "width": 8}
    dense = {name: run["methods"][0] for name, run in runs.items()}
    # the broadcast is one more collective, before the forward pass
    assert dense["default"]["collectives"] == dense["quiet"]["collectives"] + 1
    assert dense["small"]["collectives"] > dense["quiet"]["collectives"]  # more buckets


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "0", "--bandwidth", "10mbit"], "--workers must be an integer >= 1, got 0"),
        (["--workers", "4", "--bandwidth", "fast"], "bandwidth 'fast' is not understood"),
        (["--workers", "4", "--bandwidth", "unlimited"], "--bandwidth must be a finite rate"),
        (["--workers", "4", "--bandwidth", "1gbit", "--latency", "soon"], "latency 'soon'"),
        (["--workers", "4", "--bandwidth", "1gbit", "--methods", "zip"], "unknown method 'zip'"),
        (["--workers", "4", "--bandwidth", "1gbit", "--options", "{"], "--options is not valid"),
        (["--workers", "4", "--bandwidth", "1gbit", "--task-options", "[1]"], "a JSON object"),
        # found before the plan runs (it printed the table, then a bare IsADirectoryError)
        (["--workers", "4", "--bandwidth", "1gbit", "--json", "."], "--json . is a directory"),
    ],
)
def test_plan_command_rejects_bad_input(flags: list[str], message: str, capsys) -> None:
    assert main(["plan", "--task", "digits", *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_plan_refuses_what_the_library_would_refuse() -> None:
    """It once predicted 5 servers for 2 workers, and dga with a stateful compressor on
    2 lanes, both of which the library refuses."""
    from thinwire.plan.report import parse_request

    servers = '{"ps-sync": {"servers": 5}}'
    with pytest.raises(ValueError, match=r"ps-sync: 5 server\(s\) for 2 worker\(s\)"):
        parse_request("digits", 2, "100mbit", "1ms", "ps-sync", servers)
    lanes = '{"dga": {"compressor": "topk", "lanes": 2}}'
    with pytest.raises(ValueError, match="compressor 'topk' carries state"):
        parse_request("digits", 2, "100mbit", "1ms", "dga", lanes)
    assert parse_request("digits", 2, "100mbit", "1ms", "dga").methods["dga"]["lanes"] == 2
