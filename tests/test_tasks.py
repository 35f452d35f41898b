"""Training tasks: real data loads and splits deterministically, batches are pure functions of
(seed, rank, step) from each rank's own shard, models are seeded, and each task learns."""

from __future__ import annotations

import dataclasses
import gzip
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import thinwire.tasks as tasks_api
from thinwire.tasks import (
    DigitsTask,
    FashionTask,
    PackagesTask,
    Task,
    TextTask,
    register_task,
    task,
)
from thinwire.tasks.fashion import DEFAULT_DIR, load_fashion
from thinwire.tasks.idx import IDXFormatError, read_idx
from thinwire.tasks.packages import WORD, load_snippets, package_of
from thinwire.tasks.text import corpus_files, held_out, load_corpus, stdlib_dir

pytestmark = [pytest.mark.timeout(120)]

FASHION_MISSING = not Path(DEFAULT_DIR).is_dir() and os.geteuid() != 0
needs_fashion = pytest.mark.skipif(
    FASHION_MISSING,
    reason=f"{DEFAULT_DIR} is missing and we are not root to apt-get install "
    "dataset-fashion-mnist (make setup installs it as root)",
)

#: small variants of each task, fast enough for unit tests
SMALL = {
    "digits": DigitsTask(batch_size=32, hidden=64),
    "fashion": FashionTask(batch_size=16, width=8, eval_examples=200),
    "text": TextTask(
        batch_size=8,
        seq_len=32,
        embed_size=32,
        hidden_size=64,
        max_bytes=300_000,
        eval_tokens=2048,
    ),
    "packages": PackagesTask(
        batch_size=16, vocab_size=4096, classes=4, length=32, embed_size=16, hidden_size=16
    ),
}


def small(name: str) -> Task:
    if name == "fashion" and FASHION_MISSING:
        pytest.skip(f"{DEFAULT_DIR} is missing and we are not root")
    return SMALL[name]


def write_idx(path: Path, array: np.ndarray, type_code: int, compress: bool = True) -> None:
    header = bytes([0, 0, type_code, array.ndim]) + np.array(array.shape, ">u4").tobytes()
    raw = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)


# --- IDX reader and Fashion-MNIST --------------------------------------------------------


@needs_fashion
def test_fashion_files_read_with_the_right_shapes_and_labels() -> None:
    images = read_idx(Path(DEFAULT_DIR) / "train-images-idx3-ubyte.gz")
    labels = read_idx(Path(DEFAULT_DIR) / "train-labels-idx1-ubyte.gz")
    test_labels = read_idx(Path(DEFAULT_DIR) / "t10k-labels-idx1-ubyte.gz")
    assert images.shape == (60_000, 28, 28) and images.dtype == np.uint8
    assert images.max() == 255 and images.min() == 0
    assert np.bincount(labels).tolist() == [6000] * 10  # the dataset is balanced
    assert np.bincount(test_labels).tolist() == [1000] * 10
    data = load_fashion()
    assert data.test_x.shape == (10_000, 28, 28)
    assert 0.25 < data.mean < 0.35 and 0.3 < data.std < 0.4  # Fashion-MNIST: 0.286, 0.353


def test_idx_round_trip_of_every_layout(tmp_path: Path) -> None:
    values = np.arange(-6, 6, dtype=np.int32).reshape(3, 4)
    write_idx(tmp_path / "a.idx.gz", values, 0x0C)
    np.testing.assert_array_equal(read_idx(tmp_path / "a.idx.gz"), values)
    floats = np.linspace(-1, 1, 10, dtype=np.float32)
    write_idx(tmp_path / "b.idx", floats, 0x0D, compress=False)
    np.testing.assert_array_equal(read_idx(tmp_path / "b.idx"), floats)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x00\x00\x08", "too short"),
        (b"\x12\x34\x08\x01" + bytes(8), "bad IDX magic"),
        (b"\x00\x00\x42\x01" + bytes(8), "bad IDX magic"),
        (b"\x00\x00\x08\x03\x00\x00", "truncated header"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x05abc", "payload is 3 bytes"),
    ],
)
def test_idx_rejects_corrupt_files_naming_them(tmp_path: Path, raw: bytes, message: str) -> None:
    path = tmp_path / "bad-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(raw))
    with pytest.raises(IDXFormatError, match=message) as error:
        read_idx(path)
    assert str(path) in str(error.value)


def test_idx_rejects_a_corrupt_gzip_stream(tmp_path: Path) -> None:
    path = tmp_path / "cut.gz"
    path.write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x04abcd" * 100)[:20])
    with pytest.raises(IDXFormatError, match="corrupt gzip") as error:
        read_idx(path)
    assert str(path) in str(error.value)


def test_missing_fashion_files_say_how_to_install_them(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist") as error:
        FashionTask(data_dir=str(tmp_path)).batch(0, 1, 0)
    assert str(tmp_path / "train-images-idx3-ubyte.gz") in str(error.value)


# --- text corpus ---------------------------------------------------------------------------


def test_text_corpus_is_the_stdlib_without_tests_split_by_file() -> None:
    names = corpus_files(stdlib_dir())
    assert names == sorted(names) and "os.py" in names and "json/decoder.py" in names
    assert not [n for n in names if "/test/" in f"/{n}" or "site-packages" in n]
    corpus = load_corpus(max_bytes=300_000)
    assert len(corpus.train) == 300_000  # the cap applies to the training stream only
    assert sorted(corpus.train_files + corpus.held_out_files) == names
    assert not set(corpus.train_files) & set(corpus.held_out_files)
    held = [n for i, n in enumerate(names) if held_out(i, 0.05)]
    assert list(corpus.held_out_files) == held
    assert 0.04 < len(held) / len(names) <= 0.06
    first = (stdlib_dir() / held[0]).read_bytes()
    assert corpus.held_out[: len(first)].numpy().tobytes() == first
    assert b"import" in corpus.train[:5000].numpy().tobytes()
    load_corpus.cache_clear()
    again = load_corpus(max_bytes=300_000)
    assert torch.equal(again.train, corpus.train) and torch.equal(again.held_out, corpus.held_out)


def test_text_corpus_too_small_to_split(tmp_path: Path) -> None:
    (tmp_path / "only.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="too small to split"):
        load_corpus(str(tmp_path))


def test_text_batches_are_next_byte_windows_of_the_rank_shard() -> None:
    text = SMALL["text"]
    assert isinstance(text, TextTask)
    stream = text.corpus.train.numpy().tobytes()
    for rank in range(3):
        x, y = text.batch(rank, 3, step=5)
        assert x.shape == y.shape == (8, 32) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        shard = stream[rank * len(stream) // 3 : (rank + 1) * len(stream) // 3]
        for row_x, row_y in zip(x, y):
            window = bytes(row_x.tolist()) + bytes(row_y[-1:].tolist())
            assert window in shard


def test_package_snippets_are_labelled_windows_of_a_large_vocabulary() -> None:
    full = PackagesTask()
    data = full.data
    # the issue asks for 30k+ words: the table dominates the parameters
    assert len(data.vocabulary) == full.vocab_size >= 30_000
    model = full.build_model()
    table = model.embedding.weight.numel()
    assert table > 0.99 * sum(p.numel() for p in model.parameters())
    assert len(data.labels) == 16 and len(set(data.labels)) == 16
    assert {"email", "asyncio", "tkinter"} <= set(data.labels)
    assert data.train.shape[1] == full.length and data.train.dtype == torch.int64
    assert int(data.train.max()) < full.vocab_size and int(data.train.min()) >= 0
    assert set(data.held_out_labels.tolist()) <= set(range(16))
    # the split is by file: the held-out snippets are exactly the windows of the held-out
    # files of the kept packages
    names = corpus_files(stdlib_dir())
    held = [n for i, n in enumerate(names) if held_out(i, full.eval_fraction)]
    expected = sum(
        len(WORD.findall((stdlib_dir() / n).read_bytes())) // full.length
        for n in held
        if package_of(n) in data.labels
    )
    assert len(data.held_out) == expected > 0
    assert package_of("email/mime/text.py") == "email" and package_of("os.py") == "os"
    assert load_snippets(None, 32768, 16, 64, 0.05) is data  # cached


def test_package_snippets_too_small_a_corpus(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="fewer than 2 packages"):
        load_snippets(str(tmp_path), 100, 4, 8, 0.5)


# --- every task ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SMALL))
def test_batches_are_pure_functions_of_seed_rank_and_step(name: str) -> None:
    t = small(name)
    x, y = t.batch(1, 4, 7)
    x2, y2 = t.batch(1, 4, 7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(t.batch(2, 4, 7)[0], x)  # another rank, another shard
    assert not torch.equal(t.batch(1, 4, 8)[0], x)  # another step
    assert not torch.equal(dataclasses.replace(t, seed=1).batch(1, 4, 7)[0], x)
    with pytest.raises(ValueError, match="rank"):
        t.batch(4, 4, 0)


def test_image_batches_come_from_the_rank_shard() -> None:
    digits = SMALL["digits"]
    assert isinstance(digits, DigitsTask)
    for rank in range(2):
        shard = {row.numpy().tobytes() for row in digits.data.train_x[rank::2]}
        x, _ = digits.batch(rank, 2, 3)
        assert all(row.numpy().tobytes() in shard for row in x)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_build_model_is_seeded_and_leaves_the_global_rng_alone(name: str) -> None:
    t = small(name)
    before = torch.get_rng_state()
    a, b = t.build_model().state_dict(), t.build_model().state_dict()
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = dataclasses.replace(t, seed=3).build_model().state_dict()
    assert not all(torch.equal(a[k], other[k]) for k in a)


@pytest.mark.parametrize(
    ("name", "lr"), [("digits", 0.1), ("fashion", 0.05), ("text", 0.5), ("packages", 0.5)]
)
def test_a_few_sgd_steps_lower_the_loss(name: str, lr: float) -> None:
    t = small(name)
    model = t.build_model()
    x, y = t.batch(0, 2, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for _ in range(12):
        loss = t.loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("name", sorted(SMALL))
def test_evaluate_gives_a_sane_metric_and_keeps_the_mode(name: str) -> None:
    t = small(name)
    model = t.build_model()
    value = t.evaluate(model)
    assert model.training
    if t.metric == "accuracy":
        assert t.higher_is_better and 0.0 <= value <= 1.0
    else:
        assert t.metric == "perplexity" and not t.higher_is_better
        assert 150 < value < 400  # untrained: about the vocabulary size, 256
    model.eval()
    assert t.evaluate(model) == value and not model.training


def test_tasks_pickle_without_their_data() -> None:
    t = SMALL["text"]
    t.batch(0, 1, 0)
    assert len(pickle.dumps(t)) < 2000
    assert pickle.loads(pickle.dumps(t)) == t


# --- registry ------------------------------------------------------------------------------


def test_registry_builds_tasks_by_name_and_lists_what_exists() -> None:
    assert set(tasks_api.tasks()) >= {"digits", "fashion", "text"}
    built = task("text", seq_len=64, max_bytes=100_000)
    assert isinstance(built, TextTask) and built.seq_len == 64
    assert task(built) is built
    assert built.describe()["options"]["seq_len"] == 64
    assert tasks_api.task_options("fashion")["width"] == 32
    with pytest.raises(ValueError, match="unknown task 'cifar'; choose one of: digits, fashion"):
        task("cifar")
    with pytest.raises(ValueError, match=r"no option\(s\) widht; its options are: .*width"):
        task("fashion", widht=64)
    with pytest.raises(ValueError, match="ready-made"):
        task(built, seq_len=32)


def test_register_task_refuses_duplicates_and_non_dataclasses() -> None:
    with pytest.raises(ValueError, match="already taken"):

        @register_task
        @dataclasses.dataclass(frozen=True)
        class Other(DigitsTask):
            name = "digits"

    with pytest.raises(TypeError, match="dataclass"):
        register_task(type("Loose", (Task,), {"name": "loose"}))


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="tie_weights"):
        TextTask(embed_size=64, hidden_size=128, tie_weights=True)
    with pytest.raises(ValueError, match="norm"):
        FashionTask(norm="layer")
    with pytest.raises(ValueError, match="eval_examples"):
        FashionTask(eval_examples=20_000)
    # a slice end: -1000 trained on all but the last 1000 bytes, without a word
    with pytest.raises(ValueError, match=r"max_bytes must be >= 1 or None \(all\), got -1000"):
        TextTask(max_bytes=-1000)


@pytest.mark.parametrize(
    ("name", "options", "named"),
    [
        ("fashion", {"eval_examples": "100"}, "eval_examples must be an integer or None"),
        ("fashion", {"eval_examples": 5.5}, "eval_examples must be an integer or None"),
        ("fashion", {"eval_examples": True}, "eval_examples must be an integer or None"),
        ("text", {"max_bytes": "100"}, "max_bytes must be an integer or None"),
        ("text", {"root": 3}, "root must be a string or None"),
    ],
)
def test_optional_options_of_the_wrong_kind_are_refused_by_name(
    name: str, options: dict, named: str
) -> None:
    """Options whose default is None skipped the kind check: bare comparison or slice
    errors, or a float or True taken as a count."""
    from thinwire.tasks import task

    with pytest.raises(ValueError, match=named):
        task(name, **options)
    tied = TextTask(embed_size=32, hidden_size=32, tie_weights=True, max_bytes=100_000)
    model = tied.build_model()
    assert model.embedding.weight is model.decoder.weight


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ((1500, 2000, 0), "2000 ranks for 1438 training examples leave some ranks none"),
        ((0, 2, -1), "step must be >= 0, got -1"),
        ((0.0, 2, 0), "rank must be an integer, got 0.0"),
    ],
)
def test_a_batch_for_an_impossible_shard_is_refused_by_name(args: tuple, named: str) -> None:
    """They raised bare errors from the random draw ("random_ expects 'from' to be less
    than 'to'", "expected non-negative integer")."""
    from thinwire.tasks import task

    with pytest.raises(ValueError, match=named):
        task("digits").batch(*args)
