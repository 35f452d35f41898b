"""Byte-level language modelling of the CPython standard library's Python sources.

The corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` in sorted
order of relative path, skipping test suites (``test``, ``tests``, ``idle_test``: large
and full of generated data), installed packages (``site-packages``) and the files that
differ between machines of one Python version (``_sysconfigdata*``, ``config-*``). About
12 MB on CPython 3.11; the text differs between Python versions, so compare runs on one.

Tokens are bytes (vocabulary 256, so the untrained perplexity is about 256). Files are
split whole and deterministically: ``eval_fraction`` of them, spread evenly through the
sorted list, are held out. The metric is perplexity per byte on held-out windows.
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from thinwire.tasks.base import Task, check_rank, seeded_init, step_generator
from thinwire.tasks.lstm import LSTMLanguageModel
from thinwire.tasks.registry import register_task

VOCAB_SIZE = 256
#: directories never read (test suites, installed packages, caches)
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages"})
_EVAL_BATCH = 32


def stdlib_dir() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: str | Path) -> list[str]:
    """Relative paths of the corpus's ``*.py`` files under ``root``, sorted."""
    root = Path(root)
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [
            d
            for d in subdirs
            if d not in SKIP_DIRS and not d.startswith(("config-", "__pycache__"))
        ]
        for file in files:
            if file.endswith(".py") and not file.startswith("_sysconfigdata"):
                found.append((Path(directory) / file).relative_to(root).as_posix())
    return sorted(found)


@dataclass(frozen=True)
class Corpus:
    """The training and held-out byte streams (uint8, 1-D) and the files in each."""

    train: Tensor
    held_out: Tensor
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]


def held_out(index: int, fraction: float) -> bool:
    """Whether file ``index`` of the sorted list is held out: every ``1/fraction``-th one."""
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)


@functools.lru_cache(maxsize=4)
def load_corpus(
    root: str | None = None, max_bytes: int | None = None, eval_fraction: float = 0.05
) -> Corpus:
    """Read every corpus file under ``root`` (default: the stdlib) and split them by file.

    Each file is followed by a newline. ``max_bytes`` cuts the training stream to its
    first ``max_bytes`` bytes; the held-out stream is always whole. Cached per arguments.
    """
    base = Path(root) if root is not None else stdlib_dir()
    names = corpus_files(base)
    if not names:
        raise FileNotFoundError(f"no *.py files under {base} to build the text corpus from")
    files: dict[bool, tuple[str, ...]] = {
        side: tuple(n for i, n in enumerate(names) if held_out(i, eval_fraction) == side)
        for side in (False, True)
    }
    if not files[True] or not files[False]:
        raise ValueError(
            f"the corpus under {base} ({len(names)} files) is too small to split with "
            f"eval_fraction={eval_fraction}: raise eval_fraction or add files"
        )

    def stream(side: bool, limit: int | None) -> Tensor:
        text = b"".join((base / name).read_bytes() + b"\n" for name in files[side])
        return torch.from_numpy(np.frombuffer(text[:limit], dtype=np.uint8).copy())

    return Corpus(stream(False, max_bytes), stream(True, None), files[False], files[True])


@register_task
@dataclass(frozen=True)
class TextTask(Task):
    """Byte-level LSTM language model of the stdlib sources; metric: held-out perplexity.

    Options:
        seed: model initialisation and batch sampling.
        batch_size: sequences per rank per step.
        seq_len: bytes per sequence (the model predicts each next byte; state starts at 0).
        embed_size, hidden_size, layers, tie_weights: the LSTM (see ``LSTMLanguageModel``).
        max_bytes: train on the first this many bytes of the training stream (``None``:
            all of it, about 11.5 MB); the held-out stream is always whole.
        eval_fraction: share of the files held out for evaluation.
        eval_tokens: predicted bytes the metric is measured on (windows of ``seq_len``
            spread evenly over the held-out stream).
        root: corpus directory (``None``: this interpreter's stdlib).

    Each rank samples windows from its own contiguous ``1/world_size`` of the training
    stream, at offsets drawn from a generator seeded with ``(seed, rank, step)``.
    """

    name = "text"
    summary = "stdlib Python sources, byte-level 2-layer LSTM (3.6 M params); perplexity/byte"
    metric = "perplexity"
    higher_is_better = False

    seed: int = 0
    batch_size: int = 16
    seq_len: int = 128
    embed_size: int = 128
    hidden_size: int = 512
    layers: int = 2
    tie_weights: bool = False
    max_bytes: int | None = None
    eval_fraction: float = 0.05
    eval_tokens: int = 16_384
    root: str | None = None

    def __post_init__(self) -> None:
        for option in ("batch_size", "seq_len", "embed_size", "hidden_size", "layers"):
            if getattr(self, option) < 1:
                raise ValueError(f"{option} must be positive, got {getattr(self, option)}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.max_bytes is not None and self.max_bytes < 1:  # a slice end: -1000 drops bytes
            raise ValueError(f"max_bytes must be >= 1 or None (all), got {self.max_bytes}")
        if self.eval_tokens < self.seq_len:
            raise ValueError(
                f"eval_tokens ({self.eval_tokens}) must be at least seq_len ({self.seq_len})"
            )
        if self.tie_weights and self.embed_size != self.hidden_size:
            raise ValueError(
                f"tie_weights needs embed_size == hidden_size, "
                f"got {self.embed_size} and {self.hidden_size}"
            )

    @property
    def corpus(self) -> Corpus:
        """The split corpus (read once per process and arguments)."""
        return load_corpus(self.root, self.max_bytes, self.eval_fraction)

    def build_model(self) -> nn.Module:
        """A byte-level LSTM language model, initialised from ``seed``."""
        return seeded_init(
            self.seed,
            lambda: LSTMLanguageModel(
                VOCAB_SIZE, self.embed_size, self.hidden_size, self.layers, self.tie_weights
            ),
        )

    def batch(self, rank: int, world_size: int, step: int) -> tuple[Tensor, Tensor]:
        """Inputs and next-byte targets, both int64 (batch_size, seq_len), from ``rank``'s shard."""
        check_rank(rank, world_size, step=step)
        train = self.corpus.train
        begin = rank * len(train) // world_size
        end = (rank + 1) * len(train) // world_size
        if end - begin < self.seq_len + 1:
            raise ValueError(
                f"rank {rank}'s shard holds {end - begin} bytes, fewer than seq_len + 1 "
                f"= {self.seq_len + 1}; raise max_bytes or lower seq_len or world_size"
            )
        generator = step_generator(self.seed, rank, step)
        starts = begin + torch.randint(
            end - begin - self.seq_len, (self.batch_size,), generator=generator
        )
        windows = train[starts[:, None] + torch.arange(self.seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Mean cross-entropy per predicted byte (nats)."""
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())

    def evaluation_windows(self) -> Tensor:
        """The held-out windows (n, seq_len + 1) the metric is measured on, int64."""
        stream = self.corpus.held_out
        span = self.seq_len + 1
        fits = len(stream) - span + 1
        if fits < 1:
            raise ValueError(f"held-out text ({len(stream)} bytes) is shorter than seq_len + 1")
        count = min(self.eval_tokens // self.seq_len, fits)
        starts = torch.linspace(0, fits - 1, count).long()
        return stream[starts[:, None] + torch.arange(span)].long()

    def evaluate(self, model: nn.Module) -> float:
        """Perplexity per byte, exp(mean cross-entropy), on :meth:`evaluation_windows`."""
        windows = self.evaluation_windows()
        was_training = model.training
        model.eval()
        total = 0.0
        try:
            with torch.no_grad():
                for chunk in windows.split(_EVAL_BATCH):
                    logits = model(chunk[:, :-1])
                    total += float(
                        nn.functional.cross_entropy(
                            logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"
                        )
                    )
        finally:
            model.train(was_training)
        return math.exp(total / windows[:, 1:].numel())
