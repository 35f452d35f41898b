"""Real training on 4 gloo ranks: every compressor reaches dense quality; resume is exact."""

from __future__ import annotations

import numpy as np
import pytest

from thinwire.tasks.digits_training import DigitsRun, train_digits

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STEPS = 300

#: Each compressor with options suited to a 0.1 M-parameter MLP (dense tensors up to 64 K
#: entries: DGC keeps 0.5 % after a short warm-up, top-k 1 %).
METHODS = {
    "fp16": {},
    "bf16": {},
    "topk": {"density": 0.01},
    # at 0.25 (the edge: below it random-k diverges at lr 0.1, momentum 0.9) the outcome
    # depends on which subsets are drawn: three seedings of the same uniform draws ended
    # at 0.63, 0.93 and 0.98 against dense's 0.98; at 0.35 all three pass
    "randomk": {"density": 0.35},
    "dgc": {"density": 0.005, "warmup_steps": 60},
    "powersgd": {"rank": 4},
    "powersgd-oneround": {"rank": 4},
    "onebit": {},
    "signsgd": {},
    "terngrad": {},
    "qsgd": {},
}


@pytest.fixture(scope="module")
def dense_accuracy(pool4) -> float:
    results = pool4.run(train_digits, DigitsRun(method="none", steps=STEPS))
    return results[0]["test_accuracy"]


def test_every_registered_compressor_is_covered() -> None:
    import thinwire

    assert set(thinwire.compressors()) - {"none"} == set(METHODS)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_compressor_trains_to_dense_quality(pool4, dense_accuracy: float, method: str) -> None:
    results = pool4.run(
        train_digits, DigitsRun(method=method, options=METHODS[method], steps=STEPS)
    )
    accuracies = {r["test_accuracy"] for r in results}
    assert len(accuracies) == 1, f"ranks ended with different models: {accuracies}"
    accuracy = accuracies.pop()
    assert dense_accuracy > 0.95
    assert accuracy >= dense_accuracy - 0.02, (method, accuracy, dense_accuracy)
    if method not in ("fp16", "bf16"):
        assert results[0]["compression_ratio"] > 2.5, results[0]["compression_ratio"]


@pytest.mark.parametrize(
    ("method", "options", "front_end"),
    [
        ("dgc", {"density": 0.01, "warmup_steps": 10}, "ddp"),
        ("powersgd", {"rank": 2}, "ddp"),
        ("powersgd-oneround", {"rank": 2}, "optimizer"),
        ("terngrad", {}, "optimizer"),
        ("topk", {"density": 0.02}, "optimizer"),
    ],
)
def test_resume_from_checkpoint_equals_uninterrupted_run(
    pool2, tmp_path, method: str, options: dict, front_end: str
) -> None:
    common = {"method": method, "options": options, "steps": 30, "front_end": front_end}
    whole = pool2.run(train_digits, DigitsRun(**common))
    pool2.run(train_digits, DigitsRun(**common, stop_after=15, checkpoint=str(tmp_path)))
    resumed = pool2.run(train_digits, DigitsRun(**common, resume=str(tmp_path)))
    for rank in range(2):
        assert resumed[rank]["steps"] == 15
        for a, b in zip(whole[rank]["weights"], resumed[rank]["weights"]):
            np.testing.assert_array_equal(a, b)


def test_optimizer_wrapper_equals_ddp_hook(pool2) -> None:
    via_ddp = pool2.run(train_digits, DigitsRun(method="none", steps=20))
    via_wrapper = pool2.run(train_digits, DigitsRun(method="none", steps=20, front_end="optimizer"))
    for a, b in zip(via_ddp[0]["weights"], via_wrapper[0]["weights"]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
