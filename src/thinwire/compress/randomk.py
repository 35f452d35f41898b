"""Random-k sparsification with shared randomness: every rank keeps the same k entries.

    idx    = a uniformly random k-subset of [0, n), drawn from (seed, key, step)
    send     g[idx] / N                   fp32 values only: no indices travel
    mean   = scatter(sum over ranks of the values at idx)

All ranks derive the same indices from the same seed, so the payloads line up and can be
summed in a ring all-reduce. With ``rescale`` the values are multiplied by n/k, which makes
the estimator unbiased; without it (the default) the dropped entries wait in the
error-feedback residual instead.

Sampling k of n without replacement: ``torch.randperm(n)`` costs O(n) (almost a second for
25 M entries), so the indices come from O(k) uniform draws with replacement, deduplicated
(a sort), topped up if duplicates left fewer than k, and cut down to k by a random subset.
Every step of that is symmetric under relabelling the n entries, so the result is a
uniformly random k-subset: each entry is kept with probability exactly k/n. Once k is a
large part of n, ``randperm`` is as cheap as the draws and is used instead. Small tensors
(up to :data:`~thinwire.compress.segments.SMALL` values), alone or a bucket's side by side,
take their subsets from a counter-based generator instead, all of them in a fixed number
of operations (:mod:`thinwire.compress.shared_subsets`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.base import (
    Aggregation,
    Compressor,
    Exchange,
    Exchanged,
    Memory,
    Request,
    Slot,
    check_fraction,
    num_selected,
)
from thinwire.compress.feedback import NoMemory, ResidualMemory
from thinwire.compress.registry import register_compressor
from thinwire.compress.segments import SMALL
from thinwire.compress.shared_subsets import SharedSubsets


@register_compressor
@dataclass
class RandomK(Compressor):
    """Random-k with a seed shared by all ranks: summable values, no indices on the wire.

    Options:
        density: fraction of entries kept, in (0, 1].
        seed: the shared seed; the indices of a tensor depend on (seed, key, step) only.
        rescale: multiply the kept values by n/k (unbiased, for use without error
            feedback); off by default because error feedback keeps what was dropped.
    """

    density: float = 0.01
    seed: int = 0
    rescale: bool = False

    name = "randomk"
    summary = "random-k sparsification, indices from a shared seed (none sent), summed"
    aggregation = Aggregation.SUM
    wants_error_feedback = True
    segmented = True

    def __post_init__(self) -> None:
        self._layouts: dict[tuple[int, ...], SharedSubsets] = {}
        self.density = check_fraction("density", self.density)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.rescale, bool):
            raise ValueError(f"rescale must be True or False, got {self.rescale!r}")

    def make_memory(self) -> Memory:
        """Residual error feedback, except when rescaled: the unbiased estimator is meant to
        be used alone (fed back, the n/k-scaled values would make the residual grow)."""
        return NoMemory() if self.rescale else ResidualMemory()

    def compresses(self, tensor: Tensor) -> bool:
        """Tensors of one dimension (biases, norms) go dense."""
        return tensor.dim() > 1

    def indices(self, numel: int, slot: Slot) -> Tensor:
        """The sorted flat indices kept at ``slot``: the same on every rank. A small
        tensor keeps the subset :meth:`subsets` draws for it (as it does side by side with
        others, :meth:`exchange_segmented`), a larger one a sample drawn in O(k)."""
        k = num_selected(numel, self.density)
        if numel <= SMALL:
            return self.subsets((numel,)).pick([self.subset_seed(slot)])
        generator = torch.Generator().manual_seed(stable_seed(self.seed, slot.key, slot.step))
        return sample_without_replacement(numel, k, generator)

    def subsets(self, sizes: tuple[int, ...]) -> SharedSubsets:
        """The draws for small tensors of ``sizes`` side by side (made once per layout)."""
        layout = self._layouts.get(sizes)
        if layout is None:
            ks = [num_selected(n, self.density) for n in sizes]
            layout = self._layouts.setdefault(sizes, SharedSubsets(sizes, ks))
        return layout

    def subset_seed(self, slot: Slot) -> int:
        """A small tensor's seed at ``slot``: from the shared seed, its key and the step."""
        return stable_seed(self.seed, slot.key, slot.step, "subset")

    def exchange(self, tensor: Tensor, slot: Slot) -> Exchange:
        """Sum the values at the shared indices over ranks and scatter them."""
        flat = tensor.reshape(-1)
        indices = to_device(self.indices(flat.numel(), slot), flat.device)
        values = flat.index_select(0, indices)
        if self.rescale:
            values.mul_(flat.numel() / indices.numel())
        (summed,) = yield Request.sum(values / slot.world_size)
        mean = torch.zeros_like(flat).index_copy_(0, indices, summed)
        if not self.rescale:  # exactly the kept values were sent: the memory zeroes them
            return Exchanged(mean=mean.view_as(tensor), local=None, sent_indices=indices)
        local = torch.zeros_like(flat).index_copy_(0, indices, values)
        return Exchanged(mean=mean.view_as(tensor), local=local.view_as(tensor))

    def exchange_segmented(
        self, flat: Tensor, shapes: Sequence[torch.Size], slots: Sequence[Slot]
    ) -> Exchange:
        """:meth:`exchange` for small tensors side by side in ``flat``: each tensor keeps
        a uniformly random k-subset of its entries (drawn from the shared seed, its key and
        the step: the same on every rank, and whatever the bucket's layout, which DDP
        changes after its first step), one all-reduce of all the kept values."""
        layout = self.subsets(tuple(math.prod(shape) for shape in shapes))
        first = slots[0]
        chosen = layout.pick([self.subset_seed(slot) for slot in slots])
        indices = to_device(chosen, flat.device)
        values = flat.index_select(0, indices)
        if self.rescale:
            values.mul_(to_device(layout.kept_fraction, flat.device).reciprocal())
        (summed,) = yield Request.sum(values / first.world_size)
        mean = torch.zeros_like(flat).index_copy_(0, indices, summed)
        if not self.rescale:
            return Exchanged(mean=mean, local=None, sent_indices=indices, sent_counts=layout.ks)
        local = torch.zeros_like(flat).index_copy_(0, indices, values)
        return Exchanged(mean=mean, local=local)

    def compress(self, tensor: Tensor, slot: Slot) -> tuple[list[Tensor], Any]:
        """Encode for inspection and tests: ``([values], (indices, numel))``."""
        flat = tensor.reshape(-1)
        indices = to_device(self.indices(flat.numel(), slot), flat.device)
        values = flat.index_select(0, indices)
        if self.rescale:
            values.mul_(flat.numel() / indices.numel())
        return [values], (indices, flat.numel())

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """Scatter ``[values]`` to the indices in ``ctx`` (a flat tensor)."""
        (values,) = payload
        indices, numel = ctx
        out = torch.zeros(numel, dtype=values.dtype, device=values.device)
        return out.index_copy_(0, indices, values)


def sample_without_replacement(n: int, k: int, generator: torch.Generator) -> Tensor:
    """A uniformly random k-subset of ``range(n)``, sorted, in O(k log k) for k << n."""
    if k * 4 >= n:
        return torch.randperm(n, generator=generator)[:k].sort().values
    kept = torch.empty(0, dtype=torch.int64)
    while kept.numel() < k:
        # about k*k/(2n) draws collide; draw a little more than that in one go
        draws = torch.randint(n, (k - kept.numel() + k * k // n + 16,), generator=generator)
        kept = torch.unique(torch.cat([kept, draws]))
    if kept.numel() > k:
        kept = kept[torch.randperm(kept.numel(), generator=generator)[:k]].sort().values
    return kept


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` (on the CPU) moved to ``device``; to a GPU through pinned memory, so that
    the host does not wait for the copy (PyTorch keeps the pinned block until it is
    done)."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from ``parts`` that is the same in every process (unlike ``hash``)."""
    text = "|".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
