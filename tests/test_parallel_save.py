"""A hybrid-parallel trainer's checkpoint is written atomically: a run killed while saving
leaves the last checkpoint whole, and a save interrupted between its two renames is found."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint

from thinwire.errors import CheckpointError
from thinwire.parallel import ParallelPlan, parallelize
from thinwire.parallel.atomic_save import partial_of, retired_of
from thinwire.tasks.transformer import TransformerConfig, TransformerLM

VOCAB, SEQ = 32, 8


def _trainer() -> Any:
    """Two pipeline stages over the two ranks, AdamW, a tiny Llama-style model."""
    torch.manual_seed(0)
    model = TransformerLM(
        TransformerConfig(style="llama", vocab=VOCAB, dim=16, layers=2, heads=2, max_seq=SEQ)
    )
    plan = ParallelPlan(dp=1, pp=2, tp=1, microbatches=2)
    return parallelize(model, plan, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))


def _train(trainer: Any, steps: int) -> None:
    generator = torch.Generator().manual_seed(trainer.steps)
    for _ in range(steps):
        batch = torch.randint(0, VOCAB, (4, SEQ + 1), generator=generator)
        trainer.step(batch[:, :-1], batch[:, 1:])


def _save_twice_then_fail(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Save after 1 step, save again after 2 (replacing it), then a save that fails on
    rank 1 inside DCP's write after 3; then resume a fresh trainer from the folder."""
    path = Path(folder) / "ckpt"
    trainer = _trainer()
    _train(trainer, 1)
    trainer.save(path)
    _train(trainer, 1)
    trainer.save(path)
    weights = {k: v.clone() for k, v in trainer.full_state_dict().items()}
    _train(trainer, 1)
    writer = torch.distributed.checkpoint.FileSystemWriter
    original = writer.write_data

    def broken(self: Any, plan: Any, planner: Any) -> Any:
        if rank == 1:  # as a full disk would, inside DCP's write, which tells every rank
            raise OSError("disk full (simulated)")
        return original(self, plan, planner)

    writer.write_data = broken
    try:
        trainer.save(path)
        failed = "no error"
    except CheckpointError as error:  # DCP gathers every rank's failure: raised everywhere
        failed = f"{type(error).__name__}: {error}"
    finally:
        writer.write_data = original
    trainer.close()
    fresh = _trainer()
    fresh.load(path)
    resumed = fresh.full_state_dict()
    same = all(torch.equal(resumed[k], v) for k, v in weights.items())
    fresh.close()
    return {"failed": failed, "steps": fresh.steps, "same": same}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_failed_save_leaves_the_last_checkpoint_whole(pool2, tmp_path: Path) -> None:
    for result in pool2.run(_save_twice_then_fail, str(tmp_path), timeout=150):
        assert result["failed"] != "no error", result
        assert "disk full (simulated)" in result["failed"], result
        assert "rank 1 failed" in result["failed"] and "unchanged" in result["failed"], result
        assert result["steps"] == 2 and result["same"], result
    assert [p.name for p in tmp_path.iterdir() if p.name != ".ckpt.partial"] == ["ckpt"]


def _resume_from(rank: int, world: int, folder: str) -> tuple[int, list[str]]:
    trainer = _trainer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.load(Path(folder) / "ckpt")
    trainer.close()
    return trainer.steps, [str(w.message) for w in caught]


def _save_once(rank: int, world: int, folder: str) -> None:
    trainer = _trainer()
    _train(trainer, 3)
    trainer.save(Path(folder) / "ckpt")
    trainer.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_save_interrupted_between_its_renames_resumes_from_the_old(pool2, tmp_path) -> None:
    pool2.run(_save_once, str(tmp_path), timeout=120)
    path = tmp_path / "ckpt"
    partial_of(path).mkdir()  # a crash's leftovers: half a newer checkpoint...
    (partial_of(path) / "junk").write_bytes(b"x")
    path.rename(retired_of(path))  # ...and the old one moved aside, the new not yet in place
    for steps, messages in pool2.run(_resume_from, str(tmp_path), timeout=120):
        assert steps == 3
        assert any("interrupted" in m and ".ckpt.old" in m for m in messages), messages
    pool2.run(_save_once, str(tmp_path), timeout=120)  # the next save cleans up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _resume_from_each(rank: int, world: int, folders: list[str]) -> list[str]:
    trainer = _trainer()
    messages = []
    for folder in folders:
        try:
            trainer.load(folder)
            messages.append("no error")
        except CheckpointError as error:
            messages.append(str(error))
    trainer.close()
    return messages


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_missing_or_unfinished_checkpoint_is_named(pool2, tmp_path: Path) -> None:
    (tmp_path / "unfinished").mkdir()
    folders = [str(tmp_path / "nothing-here"), str(tmp_path / "unfinished")]
    for missing, unfinished in pool2.run(_resume_from_each, folders, timeout=100):
        assert "no checkpoint at" in missing and "nothing-here" in missing, missing
        assert "has no metadata" in unfinished and "did not finish" in unfinished, unfinished


def _checkpoints_with_a_trainer(rank: int, world: int, folder: str) -> dict[str, Any]:
    """thinwire.Checkpoints holding a trainer beside a plain object: saves at steps 1 and
    2 (keep=1 prunes step 1, its DCP folder too), a fresh trainer restores step 2."""
    import thinwire

    checkpoints = thinwire.Checkpoints(folder, keep=1)
    trainer = _trainer()
    counter = torch.nn.Linear(1, 1)  # any per-rank object beside the trainer
    for step in (1, 2):
        _train(trainer, 1)
        checkpoints.save(step, trainer=trainer, counter=counter)
    weights = {k: v.clone() for k, v in trainer.full_state_dict().items()}
    _train(trainer, 1)
    trainer.close()
    fresh = _trainer()
    restored = checkpoints.restore(trainer=fresh, counter=torch.nn.Linear(1, 1))
    resumed = fresh.full_state_dict()
    fresh.close()
    return {
        "restored": restored,
        "steps": fresh.steps,
        "same": all(torch.equal(resumed[k], v) for k, v in weights.items()),
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_checkpoints_save_and_restore_a_trainer_beside_other_objects(pool2, tmp_path) -> None:
    for result in pool2.run(_checkpoints_with_a_trainer, str(tmp_path), timeout=150):
        assert result == {"restored": 2, "steps": 2, "same": True}, result
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]
    assert (tmp_path / "step-00000002" / "trainer" / ".metadata").exists()
