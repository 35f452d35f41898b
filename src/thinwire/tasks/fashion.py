"""Fashion-MNIST with a CIFAR-style ResNet-18: 60k training and 10k test 28x28 images.

The data comes from the Debian package ``dataset-fashion-mnist`` (IDX gzip files in
``/usr/share/datasets/fashion-mnist/``); nothing is downloaded. Pixels are scaled to [0, 1]
and standardised with the training set's mean and standard deviation.

Normalisation is BatchNorm by default: at the benchmark's per-rank batches (32 and up)
its statistics are sound, DDP keeps the running statistics in step by broadcasting rank
0's buffers, and it is the ResNet everyone measures. ``norm="group"`` swaps in GroupNorm
(8 channels a group), which does not depend on the batch, for runs with tiny per-rank
batches or a front end that never synchronises buffers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from thinwire.tasks.base import Task, check_rank, seeded_init, step_generator
from thinwire.tasks.idx import read_idx
from thinwire.tasks.registry import register_task
from thinwire.tasks.resnet import ResNet18, norm_layer

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train_x": "train-images-idx3-ubyte.gz",
    "train_y": "train-labels-idx1-ubyte.gz",
    "test_x": "t10k-images-idx3-ubyte.gz",
    "test_y": "t10k-labels-idx1-ubyte.gz",
}
#: examples per split, as the dataset defines them
COUNTS = {"train": 60_000, "test": 10_000}
_EVAL_BATCH = 200


@dataclass(frozen=True)
class FashionData:
    """Images as uint8 (N, 28, 28), labels as int64 (N,), and the training pixel statistics."""

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    mean: float
    std: float

    def normalise(self, images: Tensor) -> Tensor:
        """uint8 images (N, 28, 28) as standardised float32 (N, 1, 28, 28)."""
        return ((images.float() / 255.0 - self.mean) / self.std).unsqueeze(1)


def _read(data_dir: Path, key: str) -> np.ndarray:
    path = data_dir / FILES[key]
    if not path.is_file():
        raise FileNotFoundError(
            f"Fashion-MNIST file {path} is missing: install the Debian package with "
            "`apt-get install dataset-fashion-mnist` (as root), or pass data_dir= a "
            "directory holding the four IDX gzip files"
        )
    return read_idx(path)


@functools.lru_cache(maxsize=2)
def load_fashion(data_dir: str = DEFAULT_DIR) -> FashionData:
    """Read and check the four IDX files in ``data_dir`` (cached per directory)."""
    root = Path(data_dir)
    arrays = {key: _read(root, key) for key in FILES}
    for split, count in COUNTS.items():
        images, labels = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if images.shape != (count, 28, 28) or images.dtype != np.uint8:
            raise ValueError(
                f"{root / FILES[split + '_x']}: expected {count}x28x28 uint8 images, "
                f"got {'x'.join(map(str, images.shape))} {images.dtype}"
            )
        if labels.shape != (count,) or labels.min() < 0 or labels.max() > 9:
            raise ValueError(
                f"{root / FILES[split + '_y']}: expected {count} labels in 0..9, got shape "
                f"{labels.shape} with range {labels.min()}..{labels.max()}"
            )
    pixels = arrays["train_x"].astype(np.float64) / 255.0
    return FashionData(
        train_x=torch.from_numpy(arrays["train_x"]),
        train_y=torch.from_numpy(arrays["train_y"].astype(np.int64)),
        test_x=torch.from_numpy(arrays["test_x"]),
        test_y=torch.from_numpy(arrays["test_y"].astype(np.int64)),
        mean=float(pixels.mean()),
        std=float(pixels.std()),
    )


@register_task
@dataclass(frozen=True)
class FashionTask(Task):
    """Fashion-MNIST classification with a CIFAR-style ResNet-18; metric: test accuracy.

    Options:
        seed: model initialisation and batch sampling.
        batch_size: examples per rank per step, drawn with replacement from the rank's
            shard (every ``world_size``-th training image, starting at ``rank``).
        width: channels of the first stage (32: 2.8 M parameters; 64: the classic 11 M).
        norm: ``"batch"`` (BatchNorm) or ``"group"`` (GroupNorm; see the module docstring).
        eval_examples: evaluate on the first this many test images (``None``: all 10 000).
        data_dir: directory of the IDX gzip files.
    """

    name = "fashion"
    summary = "Fashion-MNIST 28x28, CIFAR-style ResNet-18 (width 32: 2.8 M params); accuracy"
    metric = "accuracy"
    higher_is_better = True

    seed: int = 0
    batch_size: int = 32
    width: int = 32
    norm: str = "batch"
    eval_examples: int | None = None
    data_dir: str = DEFAULT_DIR

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.width < 1:
            raise ValueError(f"width must be positive, got {self.width}")
        norm_layer(self.norm)
        if self.eval_examples is not None and not 1 <= self.eval_examples <= COUNTS["test"]:
            raise ValueError(
                f"eval_examples must be in 1..{COUNTS['test']} or None, got {self.eval_examples}"
            )

    @property
    def data(self) -> FashionData:
        """The dataset (read once per process and directory)."""
        return load_fashion(self.data_dir)

    def build_model(self) -> nn.Module:
        """A ResNet-18 for 1x28x28 images, initialised from ``seed``."""
        return seeded_init(self.seed, lambda: ResNet18(1, 10, self.width, self.norm))

    def batch(self, rank: int, world_size: int, step: int) -> tuple[Tensor, Tensor]:
        """Images (batch_size, 1, 28, 28) and labels (batch_size,) from ``rank``'s shard."""
        check_rank(rank, world_size, COUNTS["train"], step)
        data = self.data
        shard_size = len(range(rank, COUNTS["train"], world_size))
        pick = torch.randint(
            shard_size, (self.batch_size,), generator=step_generator(self.seed, rank, step)
        )
        idx = rank + world_size * pick
        return data.normalise(data.train_x[idx]), data.train_y[idx]

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Cross-entropy of the logits against the labels."""
        return nn.functional.cross_entropy(output, target)

    def evaluate(self, model: nn.Module) -> float:
        """Accuracy on the test set (or its first ``eval_examples``), in eval mode."""
        data = self.data
        count = self.eval_examples or COUNTS["test"]
        was_training = model.training
        model.eval()
        correct = 0
        try:
            with torch.no_grad():
                for start in range(0, count, _EVAL_BATCH):
                    stop = min(start + _EVAL_BATCH, count)
                    logits = model(data.normalise(data.test_x[start:stop]))
                    correct += int((logits.argmax(dim=1) == data.test_y[start:stop]).sum())
        finally:
            model.train(was_training)
        return correct / count
