"""The README's quick starts are files in ``examples/``, run here as the README shows them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from thinwire.launch import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _torchrun(
    script: Path, cwd: Path, nproc: int = 2, timeout: float = 150, **env: str
) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node N script`` from this interpreter, on a free port."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(free_port()), str(script),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


@pytest.mark.parametrize(
    ("example", "first_line"),
    [
        ("quickstart_ddp.py", "import torch"),
        ("quickstart_hybrid.py", "import torch"),
        ("quickstart_auto.py", "import logging"),
        ("quickstart_diloco.py", "import torch"),
    ],
)
def test_the_readme_shows_the_quick_start_files_as_they_are(example, first_line) -> None:
    text = (EXAMPLES / example).read_text()
    code = text[text.index(first_line) :]
    assert code in _readme_blocks()


def test_the_diloco_quick_start_runs_under_torchrun(tmp_path) -> None:
    done = _torchrun(EXAMPLES / "quickstart_diloco.py", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    fewer = [float(r) for r in re.findall(r"\((\d+)x fewer than averaging", done.stdout)]
    assert len(fewer) == 2 and all(r > 20 for r in fewer), done.stdout
    accuracy = float(re.search(r"held-out accuracy ([\d.]+) after 100 inner", done.stdout)[1])
    assert accuracy > 0.9, done.stdout
    assert (tmp_path / "diloco-ckpt.pt").exists()


def test_the_ddp_quick_start_runs_under_torchrun(tmp_path) -> None:
    done = _torchrun(EXAMPLES / "quickstart_ddp.py", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    ratios = [float(r) for r in re.findall(r"(\d+)x compressed", done.stdout)]
    assert len(ratios) == 3 and all(r > 10 for r in ratios), done.stdout
    accuracy = float(re.search(r"held-out accuracy ([\d.]+) after 60 steps", done.stdout)[1])
    assert accuracy > 0.85, done.stdout
    assert (tmp_path / "quickstart-ckpt.pt").exists()


@pytest.mark.timeout(300)
def test_the_hybrid_quick_start_runs_under_torchrun(tmp_path) -> None:
    script = EXAMPLES / "quickstart_hybrid.py"
    done = _torchrun(script, tmp_path, nproc=4, timeout=280, THINWIRE_CACHE=str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [float(x) for x in re.findall(r"step \d+ loss ([\d.]+)", done.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 1.0, done.stdout
    perplexity = float(re.search(r"held-out perplexity ([\d.]+) after 40 steps", done.stdout)[1])
    assert perplexity < 512 / 2, done.stdout  # uniform over the vocabulary would be 512
    assert (tmp_path / "quickstart-hybrid-ckpt" / ".metadata").exists()


@pytest.mark.timeout(300)
def test_the_auto_quick_start_plans_runs_and_hands_back_its_plan(tmp_path) -> None:
    from thinwire.parallel.plan_spec import parse_plan

    script = EXAMPLES / "quickstart_auto.py"
    done = _torchrun(script, tmp_path, nproc=4, timeout=280, THINWIRE_CACHE=str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "thinwire plan: " in done.stderr and "plans searched" in done.stderr, done.stderr
    losses = [float(x) for x in re.findall(r"step \d+ loss ([\d.]+)", done.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, done.stdout
    spec = re.search(r"^plan (\S+)$", done.stdout, flags=re.M)[1]
    plan = parse_plan(spec)
    assert plan.world_size == 4 and plan.spec() == spec
    logged = re.search(r"thinwire plan: (\S+), predicted", done.stderr)[1]
    assert logged == spec
