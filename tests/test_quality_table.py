"""bench/quality_table.py: the verdicts the README's quality tables are printed with."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "quality_table.py"


@pytest.fixture(scope="module")
def quality_table() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quality_table", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(method: str, metric: str, value: float, **options: Any) -> dict[str, Any]:
    return {
        "method": method,
        "options": options,
        "eval_metric": metric,
        "eval_value": value,
        "final_train_loss": 0.5,
    }


def test_accuracy_targets_are_points_dgc_stricter(quality_table: ModuleType) -> None:
    rows = quality_table.rows(
        [
            record("dense", "accuracy", 0.9200),
            record("dgc", "accuracy", 0.9110, warmup_steps=100),  # -0.90
            record("dgc", "accuracy", 0.9090),  # -1.10
            record("onebit", "accuracy", 0.9010),  # -1.90
            record("terngrad", "accuracy", 0.8990),  # -2.10
            record("dga", "accuracy", 0.9090, compressor="dgc", delay=1),  # -1.10, DGC's
        ]
    )
    assert rows[0].startswith("| dense | 92.00 % |")
    assert "| dgc (warmup_steps=100) | 91.10 % | -0.90 | within 1: met |" in rows[1]
    assert "| -1.10 | within 1: **missed** |" in rows[2]
    assert "| -1.90 | within 2: met |" in rows[3]
    assert "| -2.10 | within 2: **missed** |" in rows[4]
    assert "| -1.10 | within 1: **missed** |" in rows[5]  # a wrapper: its compressor's target


def test_perplexity_targets_are_percent(quality_table: ModuleType) -> None:
    rows = quality_table.rows(
        [
            record("powersgd", "perplexity", 4.2, rank=2),  # +5.0 %: on the line
            record("dense", "perplexity", 4.0),
            record("dgc", "perplexity", 4.16),  # +4.0 %
            record("terngrad", "perplexity", 4.21),  # +5.25 %
        ]
    )
    assert "| powersgd (rank=2) | 4.20 | +5.0 % | within 5 %: met |" in rows[0]
    assert rows[1].startswith("| dense | 4.00 |")
    assert "| +4.0 % | within 3 %: **missed** |" in rows[2]
    assert "| +5.2 % | within 5 %: **missed** |" in rows[3]


def test_one_dense_record_is_required(quality_table: ModuleType) -> None:
    with pytest.raises(SystemExit, match="exactly one dense record"):
        quality_table.rows([record("dgc", "accuracy", 0.9)])


def test_records_are_read_from_results_files(quality_table: ModuleType, tmp_path: Path) -> None:
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"records": [record("dense", "accuracy", 0.9)]}))
    second.write_text(json.dumps([record("dgc", "accuracy", 0.89)]))
    records = quality_table.load_records([first, second])
    assert [r["method"] for r in records] == ["dense", "dgc"]


def test_plot_labels_tell_repeated_methods_apart(quality_table: ModuleType) -> None:
    records = [
        record("dense", "perplexity", 3.1),
        record("dgc", "perplexity", 3.3, warmup_steps=2000),
        record("dgc", "perplexity", 3.2, masking=False, warmup_steps=2000),
        record("onebit", "perplexity", 3.2),
    ]
    labels = [r["method"] for r in quality_table.plot_labels(records)]
    # the options both dgc records share say nothing: only masking tells them apart
    assert labels == ["dense", "dgc", "dgc (masking=False)", "onebit"]
    assert [r["method"] for r in records][1] == "dgc"  # the records themselves are untouched


def test_a_wrapper_is_described_by_its_compressor_then_its_own_options(
    quality_table: ModuleType,
) -> None:
    dga = record(
        "dga",
        "accuracy",
        0.92,
        delay=1,
        lanes=1,
        compressor="dgc",
        compressor_options={"warmup_steps": 200, "masking": True},
    )
    assert quality_table.describe(dga) == (
        "dga (compressor=dgc, masking=True, warmup_steps=200, delay=1, lanes=1)"
    )
    assert quality_table.describe(record("dgc", "accuracy", 0.9, warmup_steps=2)) == (
        "dgc (warmup_steps=2)"
    )
