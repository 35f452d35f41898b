"""Lightning, Accelerate and the Hugging Face Trainer with thinwire, 2 CPU ranks each.

Each driver in ``tests/frameworks/`` trains the digits perceptron under DGC, PowerSGD and
random-k: straight through, and checkpointed half-way and resumed by the framework's own
mechanism, which must end on the same weights bit for bit on every rank, with the steps
counted alike and the compression ratio in the framework's log. Skipped with the reason
when a framework is not installed (``make test`` installs them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from thinwire.launch import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

DRIVERS = Path(__file__).resolve().parent / "frameworks"
COMPRESSORS = ("dgc", "powersgd", "randomk")


def needs(module: str) -> pytest.MarkDecorator:
    """Skip unless ``module`` can be imported."""
    missing = importlib.util.find_spec(module) is None
    return pytest.mark.skipif(
        missing, reason=f"{module} is not installed (pip install 'thinwire[{module}]')"
    )


def _run(args: list[str], torchrun: bool, out: Path) -> None:
    launcher = [sys.executable]
    if torchrun:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "--master-port", str(free_port())]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*launcher, *args, str(out)], cwd=DRIVERS, env=env, capture_output=True, text=True,
        timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def _check(
    summary: dict, same: bool | list[bool], steps: list, names: list[str] | None = None
) -> None:
    assert sorted(summary) == sorted(names or COMPRESSORS)
    for name, result in summary.items():
        assert result["same"] == same, name
        assert result["steps"] == steps, name
        assert len(result["ratios"]) == 6 and all(r > 5 for r in result["ratios"]), name


@needs("lightning")
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_lightning_resumes_every_rank_exactly(tmp_path, strategy, monkeypatch) -> None:
    # ddp_spawn starts two fresh processes per fit: one compressor there (the state's way
    # through the spawned ranks is the same for all), every one under ddp
    names = ["dgc"] if strategy == "ddp_spawn" else list(COMPRESSORS)
    monkeypatch.setenv("THINWIRE_TEST_COMPRESSORS", ",".join(names))
    _run(["lightning_resume.py", strategy], torchrun=strategy == "ddp", out=tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    _check(summary, same=[True, True], steps=[[6, 6], [6, 6]], names=names)


@needs("accelerate")
def test_accelerate_with_accumulation_resumes_every_rank_exactly(tmp_path) -> None:
    _run(["accelerate_resume.py"], torchrun=True, out=tmp_path)
    for rank in (0, 1):  # 12 micro-batches a rank, accumulated in pairs: 6 exchanges
        _check(json.loads((tmp_path / f"summary-rank{rank}.json").read_text()), True, [6, 6])


@needs("transformers")
def test_the_trainer_resumes_every_rank_exactly(tmp_path) -> None:
    _run(["transformers_resume.py"], torchrun=True, out=tmp_path)
    for rank in (0, 1):
        _check(json.loads((tmp_path / f"summary-rank{rank}.json").read_text()), True, [6, 6])
    assert (tmp_path / "dgc" / "checkpoint-3" / "thinwire.pt").exists()


@needs("lightning")
def test_lightning_without_ddp_says_which_strategy_to_use() -> None:
    from thinwire.integrations.lightning import ThinwireCallback

    class Strategy:
        model = nn.Linear(2, 2)

    class Trainer:
        strategy, optimizers = Strategy(), []

    with pytest.raises(TypeError, match="strategy='ddp'"):
        ThinwireCallback("dgc").on_fit_start(Trainer(), None)


def test_a_state_that_is_not_thinwire_is_refused() -> None:
    from thinwire.integrations.common import AllRanksState

    with pytest.raises(ValueError, match="not a thinwire integration state"):
        AllRanksState().load_state_dict({"residuals": torch.zeros(1)})


def test_a_missing_framework_names_the_extra() -> None:
    from thinwire.integrations.common import require

    with pytest.raises(ImportError, match=r"pip install 'thinwire\[lightning\]'"):
        require("no_such_framework_module", "lightning")
