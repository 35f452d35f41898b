"""Which standard-library package does a code snippet come from? A word-level task whose
input embedding dominates the model (for sharded embeddings).

Files are those of the ``text`` task (the stdlib's ``*.py``, test suites skipped), split by
file the same way. A file's label is its top-level package or module (``email``,
``asyncio``, ``tkinter``, ...); the ``classes`` largest (by training words) are kept and
the other files dropped. Words are identifiers, numbers and single punctuation characters;
the vocabulary is the ``vocab_size - 1`` most frequent words of all training files (about
60 k distinct ones on CPython 3.11) plus ``<unk>`` (id 0), ids in order of frequency. A
snippet is ``length`` consecutive words of one file (non-overlapping windows). The model
averages the words' embeddings (the table: ``vocab_size x embed_size``, e.g. 32768 x 64 =
2.1 M parameters) and classifies with a small MLP (a few thousand parameters), so nearly
all traffic of dense data parallelism is the table.
"""

from __future__ import annotations

import collections
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from thinwire.tasks.base import Task, check_rank, seeded_init, step_generator
from thinwire.tasks.registry import register_task
from thinwire.tasks.text import corpus_files, held_out, stdlib_dir

WORD = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|[^\sA-Za-z0-9_]")
_EVAL_BATCH = 256


def package_of(relative_path: str) -> str:
    """``"email/mime/text.py"`` -> ``"email"``; ``"os.py"`` -> ``"os"``."""
    first = relative_path.split("/", 1)[0]
    return first[:-3] if first.endswith(".py") else first


@dataclass(frozen=True)
class Snippets:
    """Word-id windows (n, length) int64 and their labels (n,) int64, per split; the label
    names and the vocabulary (id -> word)."""

    train: Tensor
    train_labels: Tensor
    held_out: Tensor
    held_out_labels: Tensor
    labels: tuple[str, ...]
    vocabulary: tuple[bytes, ...]


@functools.lru_cache(maxsize=4)
def load_snippets(
    root: str | None, vocab_size: int, classes: int, length: int, eval_fraction: float
) -> Snippets:
    """Read, label, tokenise and window the corpus (cached per process and arguments)."""
    base = Path(root) if root is not None else stdlib_dir()
    names = corpus_files(base)
    if not names:
        raise FileNotFoundError(f"no *.py files under {base} to build the snippets from")
    words = {name: WORD.findall((base / name).read_bytes()) for name in names}
    side = {name: held_out(i, eval_fraction) for i, name in enumerate(names)}
    size: collections.Counter[str] = collections.Counter()
    for name in names:
        if not side[name]:
            size[package_of(name)] += len(words[name])
    labels = tuple(label for label, _ in size.most_common(classes))
    if len(labels) < 2:
        raise ValueError(f"the corpus under {base} has fewer than 2 packages to classify")
    index = {label: i for i, label in enumerate(labels)}
    counts: collections.Counter[bytes] = collections.Counter()
    for name in names:  # every training file, labelled or not: a larger vocabulary
        if not side[name]:
            counts.update(words[name])
    vocabulary = (b"<unk>", *(w for w, _ in counts.most_common(vocab_size - 1)))
    ids = {w: i for i, w in enumerate(vocabulary)}
    windows: dict[bool, list[list[int]]] = {False: [], True: []}
    targets: dict[bool, list[int]] = {False: [], True: []}
    for name in names:
        label = index.get(package_of(name))
        if label is None:
            continue
        tokens = [ids.get(w, 0) for w in words[name]]
        for start in range(0, len(tokens) - length + 1, length):
            windows[side[name]].append(tokens[start : start + length])
            targets[side[name]].append(label)
    if not windows[True] or not windows[False]:
        raise ValueError(f"the corpus under {base} is too small for snippets of {length} words")

    def stack(held: bool) -> tuple[Tensor, Tensor]:
        return torch.tensor(windows[held], dtype=torch.int64), torch.tensor(targets[held])

    (train, train_labels), (test, test_labels) = stack(False), stack(True)
    return Snippets(train, train_labels, test, test_labels, labels, vocabulary)


class BagOfWords(nn.Module):
    """Mean of the words' embeddings, then ``Linear -> ReLU -> Linear``."""

    def __init__(self, vocab_size: int, embed_size: int, hidden_size: int, classes: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_size)
        self.head = nn.Sequential(
            nn.Linear(embed_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, classes)
        )

    def forward(self, ids: Tensor) -> Tensor:
        """Class scores (batch, classes) of word-id windows (batch, length)."""
        return self.head(self.embedding(ids).mean(dim=1))


@register_task
@dataclass(frozen=True)
class PackagesTask(Task):
    """Classify stdlib snippets by package; metric: held-out accuracy.

    Options:
        seed: model initialisation and batch sampling.
        batch_size: snippets per rank per step.
        vocab_size: words in the vocabulary (with ``<unk>``).
        classes: how many of the largest packages to tell apart.
        length: words per snippet.
        embed_size, hidden_size: the model.
        eval_fraction: share of the files held out.
        root: corpus directory (``None``: this interpreter's stdlib).

    Each rank samples snippets from its own contiguous ``1/world_size`` of the (shuffled
    once, with ``seed``) training snippets.
    """

    name = "packages"
    summary = "stdlib snippets by package, 32k-word bag of embeddings (2.1 M params); accuracy"
    metric = "accuracy"
    higher_is_better = True

    seed: int = 0
    batch_size: int = 32
    vocab_size: int = 32768
    classes: int = 16
    length: int = 64
    embed_size: int = 64
    hidden_size: int = 64
    eval_fraction: float = 0.05
    root: str | None = None

    def __post_init__(self) -> None:
        for option in ("batch_size", "length", "embed_size", "hidden_size"):
            if getattr(self, option) < 1:
                raise ValueError(f"{option} must be positive, got {getattr(self, option)}")
        if self.vocab_size < 2 or self.classes < 2:
            raise ValueError(
                f"vocab_size and classes must be >= 2, got {self.vocab_size}, {self.classes}"
            )
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")

    @property
    def data(self) -> Snippets:
        """The labelled snippets (read once per process and arguments)."""
        return load_snippets(
            self.root, self.vocab_size, self.classes, self.length, self.eval_fraction
        )

    def build_model(self) -> nn.Module:
        """The bag-of-embeddings classifier, initialised from ``seed``."""
        classes = len(self.data.labels)
        return seeded_init(
            self.seed,
            lambda: BagOfWords(self.vocab_size, self.embed_size, self.hidden_size, classes),
        )

    @functools.cached_property
    def _order(self) -> Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randperm(len(self.data.train), generator=generator)

    def batch(self, rank: int, world_size: int, step: int) -> tuple[Tensor, Tensor]:
        """Word ids (batch_size, length) and labels (batch_size,) from ``rank``'s shard."""
        check_rank(rank, world_size, step=step)
        count = len(self._order)
        begin, end = rank * count // world_size, (rank + 1) * count // world_size
        if end <= begin:
            raise ValueError(f"{count} training snippets cannot be shared by {world_size} ranks")
        picks = self._order[
            begin
            + torch.randint(
                end - begin, (self.batch_size,), generator=step_generator(self.seed, rank, step)
            )
        ]
        return self.data.train[picks], self.data.train_labels[picks]

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Mean cross-entropy."""
        return nn.functional.cross_entropy(output, target)

    def evaluate(self, model: nn.Module) -> float:
        """Accuracy on every held-out snippet."""
        was_training = model.training
        model.eval()
        correct = 0
        data = self.data
        with torch.no_grad():
            for start in range(0, len(data.held_out), _EVAL_BATCH):
                ids = data.held_out[start : start + _EVAL_BATCH]
                labels = data.held_out_labels[start : start + _EVAL_BATCH]
                correct += int((model(ids).argmax(dim=1) == labels).sum())
        model.train(was_training)
        return correct / len(data.held_out)
