"""The CPython sources as BPE tokens: a byte-level BPE trained once on the training files
with Hugging Face ``tokenizers`` and cached, with the token streams, under
``$THINWIRE_CACHE`` (default ``~/.cache/thinwire``). Nothing is downloaded.

The cache key is a digest of the corpus (file names and sizes), the vocabulary size and
the byte limit, so another Python version or corpus gets its own files. Files are written
to a temporary name and renamed, so ranks starting together never read half a file, and
made under a lock, so the ranks of one machine (``torchrun --nproc-per-node 8``) train the
tokeniser once: the first makes the files, the others wait for them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from thinwire.checkpoint import write_atomically
from thinwire.tasks.text import load_corpus, stdlib_dir


def cache_dir() -> Path:
    """Where tokenisers and token streams are kept."""
    return Path(os.environ.get("THINWIRE_CACHE", Path.home() / ".cache" / "thinwire"))


@dataclass(frozen=True)
class TokenCorpus:
    """Training and held-out token streams (int64, 1-D) and the vocabulary size."""

    train: Tensor
    held_out: Tensor
    vocab: int


def _key(files: tuple[str, ...], root: Path, vocab: int, max_bytes: int | None) -> str:
    sha = hashlib.sha1(f"{vocab}|{max_bytes}".encode())
    for name in files:
        sha.update(f"{name}:{(root / name).stat().st_size};".encode())
    return sha.hexdigest()[:16]


def _train_tokenizer(text: bytes, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = text.decode("utf-8", errors="replace").splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer)
    return tokenizer


def _encode(tokenizer, text: bytes) -> np.ndarray:
    lines = text.decode("utf-8", errors="replace").splitlines(keepends=True)
    ids = [i for encoding in tokenizer.encode_batch(lines) for i in encoding.ids]
    return np.asarray(ids, dtype=np.int32)


def load_tokens(
    vocab: int = 2048, max_bytes: int | None = None, root: str | None = None
) -> TokenCorpus:
    """The corpus of :mod:`thinwire.tasks.text` as BPE tokens of a ``vocab``-sized
    vocabulary (trained on the training files only), from the cache or made and cached."""
    corpus = load_corpus(root, max_bytes)
    base = Path(root) if root is not None else stdlib_dir()
    key = _key(corpus.train_files + corpus.held_out_files, base, vocab, max_bytes)
    folder = cache_dir() / f"tokens-{key}"
    paths = {name: folder / f"{name}.npy" for name in ("train", "held_out")}
    if not all(p.exists() for p in paths.values()):
        with _one_maker(folder):
            if not all(p.exists() for p in paths.values()):  # else another rank made them
                _make(corpus.train, corpus.held_out, vocab, folder, paths)
    loaded = {
        name: torch.from_numpy(np.load(path).astype(np.int64)) for name, path in paths.items()
    }
    return TokenCorpus(loaded["train"], loaded["held_out"], vocab)


@contextlib.contextmanager
def _one_maker(folder: Path) -> Iterator[None]:
    """Hold this machine's lock on making ``folder``'s files."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _make(
    train: Tensor, held_out: Tensor, vocab: int, folder: Path, paths: dict[str, Path]
) -> None:
    """Train the tokeniser on the ``train`` bytes; write it and both token streams."""
    train_text = train.numpy().tobytes()
    tokenizer = _train_tokenizer(train_text, vocab)
    streams = {
        "train": _encode(tokenizer, train_text),
        "held_out": _encode(tokenizer, held_out.numpy().tobytes()),
    }
    folder.mkdir(parents=True, exist_ok=True)
    write_atomically(folder / "tokenizer.json", tokenizer.to_str().encode())
    for name, stream in streams.items():
        buffer = io.BytesIO()
        np.save(buffer, stream)
        write_atomically(paths[name], buffer.getvalue())
