"""The ``gpt`` task: BPE tokens of the stdlib sources made once and cached, batches the
same on every rank, a model that learns, and its perplexity through one process and
through a parallel trainer."""

from __future__ import annotations

import math

import pytest
import torch

from thinwire.tasks import task
from thinwire.tasks.tokens import cache_dir, load_tokens

pytestmark = pytest.mark.timeout(300)

SMALL = {"max_bytes": 300_000, "vocab": 512, "dim": 32, "layers": 2, "heads": 4, "seq_len": 32}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THINWIRE_CACHE", str(tmp_path))


def test_tokens_are_made_once_then_read_from_the_cache() -> None:
    first = load_tokens(512, max_bytes=300_000)
    files = sorted(p.name for p in cache_dir().rglob("*") if p.is_file())
    assert [f for f in files if not f.endswith(".lock")] == [
        "held_out.npy",
        "tokenizer.json",
        "train.npy",
    ]
    stamp = {p: p.stat().st_mtime_ns for p in cache_dir().rglob("*.npy")}
    again = load_tokens(512, max_bytes=300_000)
    assert {p: p.stat().st_mtime_ns for p in cache_dir().rglob("*.npy")} == stamp
    assert torch.equal(first.train, again.train)
    assert int(first.train.max()) < 512 and int(first.train.min()) >= 0
    # BPE merges bytes: fewer tokens than bytes
    assert len(first.train) < 300_000 * 0.6


def _load_counting(log: str, results) -> None:  # type: ignore[no-untyped-def]
    """In a fresh process: load the tokens, noting in ``log`` each tokeniser trained."""
    import thinwire.tasks.tokens as tokens

    train = tokens._train_tokenizer

    def counted(text, vocab):  # type: ignore[no-untyped-def]
        with open(log, "a") as out:
            out.write("trained\n")
        return train(text, vocab)

    tokens._train_tokenizer = counted
    results.put(int(load_tokens(512, max_bytes=300_000).train.sum()))


def test_ranks_starting_together_train_the_tokeniser_once(tmp_path) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    log = tmp_path / "trained.log"
    procs = [ctx.Process(target=_load_counting, args=(str(log), results)) for _ in range(3)]
    for proc in procs:
        proc.start()
    sums = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    assert all(proc.exitcode == 0 for proc in procs)
    assert log.read_text() == "trained\n"  # the other two waited and read its files
    assert len(set(sums)) == 1


def test_the_global_batch_is_the_same_on_every_call_and_targets_are_shifted() -> None:
    gpt = task("gpt", **SMALL)
    inputs, targets = gpt.global_batch(3)
    again, _ = gpt.global_batch(3)
    assert torch.equal(inputs, again) and inputs.shape == (32, 32)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert not torch.equal(inputs, gpt.global_batch(4)[0])


def test_a_few_steps_lower_the_held_out_perplexity() -> None:
    gpt = task("gpt", **SMALL, eval_tokens=2048)
    model = gpt.build_model()
    before = gpt.evaluate(model)
    assert before == pytest.approx(512, rel=0.3)  # about uniform over the vocabulary
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(30):
        x, y = gpt.global_batch(step)
        opt.zero_grad()
        gpt.loss(model(x), y).backward()
        opt.step()
    after = gpt.evaluate(model)
    assert after < before / 2 and math.isfinite(after)
