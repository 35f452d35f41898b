"""Deep Gradient Compression (Lin et al., ICLR 2018): top-k of the accumulated velocity.

The memory (:class:`~thinwire.compress.feedback.DGCMemory`) does the momentum correction,
local clipping and momentum factor masking and hands over the accumulator ``v``; this
compressor only chooses which entries of ``v`` travel, and how many::

    k      = density_at(step) * n           exponential warm-up: 25%, 6.25%, 1.56%, ...
    thr    = k-th largest |v| of a ~1% sample, aimed slightly low
    cand   = {i : |v_i| >= thr}             retry with a lower thr while |cand| < k
    idx    = argtop_k |v[cand]|             exactly the top-k set, k entries on every rank
    send     (v[idx], idx)                  fp32 values + int32 indices, gathered

Exact ``torch.topk`` over 25 M entries costs a partial sort of the whole tensor; the sampled
threshold costs one pass for ``|v|``, one for the mask and a scan of the mask, and the
final top-k only sorts the ~k candidates, so the payload is the same as exact top-k's.

On a GPU each try above reads a count back on the host, which stalls the exchange. There
(``selection="threshold"``, the default on every device but the CPU) the selection keeps
to the device::

    thr    = a-th largest |v| of the sample, a two standard deviations below the
             sample's share of k (one try; at least 256 sampled above it where it can)
    cand   = {i : |v_i| >= thr and v_i != 0}       about 7/8 k, rarely more than k
    idx    = the first k of cand (torch.nonzero_static: no count read back), padded
             with a sent index and the value 0 when |cand| < k

so about 7/8 of k entries, all at or above the estimated k-th magnitude; what it leaves
(all of cand past the first k, in the rare step where more than k pass) stays in the
memory and grows until it goes, as every unsent entry does. A bucket's large tensors
take it side by side, with a fixed number of kernels whatever their count
(:mod:`thinwire.compress.dgc_segments`). With Triton on a GPU the passes over the tensor
run in fused kernels that pick the same pairs (:mod:`thinwire.compress.fused`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from thinwire.compress import fused
from thinwire.compress.base import (
    Exchange,
    Exchanged,
    Memory,
    Slot,
    check_fraction,
    is_integer,
    num_selected,
)
from thinwire.compress.bits import ScratchBuffer
from thinwire.compress.dgc_segments import ThresholdSegments, aim_below
from thinwire.compress.feedback import DGCMemory
from thinwire.compress.registry import register_compressor
from thinwire.compress.segments import SMALL
from thinwire.compress.topk import TopK, gather_sparse

#: warm-up stages start at this density and shrink by WARMUP_FACTOR until the target
WARMUP_START = 0.25
WARMUP_FACTOR = 4.0


@register_compressor
@dataclass
class DGC(TopK):
    """Deep Gradient Compression: sampled-threshold top-k, DGC memory, density warm-up.

    Options:
        density: fraction of entries sent once warmed up, in (0, 1].
        momentum: the momentum DGC applies in its memory; the optimizer must not add its own.
        max_norm: local gradient clipping: each worker clips to ``max_norm / sqrt(N)``;
            ``None`` disables it.
        masking: momentum factor masking (zero the velocity of the entries sent), as
            published; off by default: on a small LSTM at 20 000 steps it ended 4.7 %
            above dense's perplexity against 2.7 % without it, and it made no difference
            on the image task (docs/measurements.md, "Quality").
        weight_decay: added to the gradient before momentum.
        warmup_steps: steps of exponential warm-up (densities 0.25, 0.0625, ... down to
            ``density``, in equal stages), as the paper trains; 0 starts at ``density``.
            The default, 1000, kept DGC within 2.4 % of dense's held-out perplexity on the
            text task at 20 000 steps (docs/measurements.md, "DGC's default warm-up");
            without warm-up a character LSTM ended 12 % above dense. Set it to a few
            epochs of your run.
        sample_fraction: fraction of |v| sampled to estimate the threshold, in (0, 1].
        seed: seeds the generator of the sample offsets (checkpointed).
        selection: how tensors larger than the segments' limit choose their entries:
            ``"exact"``, exactly the top-k set (a few host reads per tensor);
            ``"threshold"``, about k entries above a sampled threshold without reading
            anything back (what a GPU needs: no host wait); ``"auto"`` (default):
            exact on the CPU, threshold elsewhere. Small tensors always send their exact
            top-k (side by side in one padded ``torch.topk``).
    """

    density: float = 0.001
    momentum: float = 0.9
    max_norm: float | None = None
    masking: bool = False
    weight_decay: float = 0.0
    warmup_steps: int = 1000
    sample_fraction: float = 0.01
    seed: int = 0
    #: not in the repr, which names a checkpoint's owner and what the ranks must agree
    #: on: the selection keeps no state and sends the same k pairs either way (so a
    #: checkpoint from before this option, or from a GPU run, resumes on the CPU)
    selection: str = field(default="auto", repr=False)

    name = "dgc"
    summary = "Deep Gradient Compression: sampled top-k, momentum correction, warm-up"

    #: threshold tries (each lower than the last) before falling back to exact top-k
    tries = 3
    #: the threshold aims this many standard deviations of the sample count below k
    margin_sigmas = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sample_fraction = check_fraction("sample_fraction", self.sample_fraction)
        if not is_integer(self.warmup_steps) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not is_integer(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        self.warmup_steps, self.seed = int(self.warmup_steps), int(self.seed)
        if self.selection not in SELECTIONS:
            raise ValueError(
                f"selection must be one of {', '.join(map(repr, SELECTIONS))}, "
                f"got {self.selection!r}"
            )
        self.make_memory()  # validates momentum, max_norm and weight_decay
        self.momentum, self.weight_decay = float(self.momentum), float(self.weight_decay)
        self.max_norm = None if self.max_norm is None else float(self.max_norm)
        self.stages = warmup_stages(self.density)
        self.stride = _prime_at_least(round(1 / self.sample_fraction))
        self.generator = torch.Generator().manual_seed(self.seed)
        #: candidates the last selection took its top-k from (n after an exact fallback;
        #: -1 after a threshold selection, which reads no count back)
        self.last_candidates = 0
        #: thresholds the last selection tried (0: it went straight to exact top-k)
        self.last_tries = 0
        self._strides: dict[int, int] = {}
        self._threshold_layouts: dict[tuple[Any, float], ThresholdSegments] = {}
        self._magnitude = ScratchBuffer()
        self._mask = ScratchBuffer()

    # -- what DGC adds to top-k -----------------------------------------------------------

    def make_memory(self) -> Memory:
        """DGC's momentum-corrected memory with this compressor's options."""
        return DGCMemory(self.momentum, self.max_norm, self.masking, self.weight_decay)

    @property
    def applies_momentum(self) -> bool:
        """DGC's memory applies ``momentum`` (unless it is 0)."""
        return self.momentum != 0

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer with its own momentum: DGC's memory already applies it."""
        if self.momentum == 0:
            return
        for index, group in enumerate(optimizer.param_groups):
            if group.get("momentum", 0) or "betas" in group:
                what = f"momentum={group['momentum']}" if "momentum" in group else "betas"
                raise ValueError(
                    f"dgc applies momentum={self.momentum} itself, but param group {index} of "
                    f"{type(optimizer).__name__} has {what}: momentum would be applied twice. "
                    "Use torch.optim.SGD(momentum=0) with dgc, or dgc(momentum=0)."
                )

    def density_at(self, slot: Slot) -> float:
        """The warm-up density at ``slot.step``: equal stages of 0.25, 0.0625, ..., then
        ``density``."""
        if slot.step >= self.warmup_steps or not self.stages:
            return self.density
        return self.stages[slot.step * len(self.stages) // self.warmup_steps]

    # -- selection: the hot path ----------------------------------------------------------

    def by_threshold(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` take the threshold selection (no host wait)."""
        if self.selection == "auto":
            return device.type != "cpu"
        return self.selection == "threshold"

    def segments_large(self, device: torch.device) -> bool:
        """Large tensors go side by side too where the threshold selection takes them."""
        return self.by_threshold(device)

    def exchange_segmented(
        self, flat: Tensor, shapes: Sequence[torch.Size], slots: Sequence[Slot]
    ) -> Exchange:
        """Small tensors side by side: each one's exact top-k (as top-k does). Large ones
        side by side (on a device that takes the threshold selection): about k of each
        above its own sampled threshold, every segment at once (no host wait). With
        ``partitioned``, top-k's partitioned exchange for all of them at once."""
        if self.partitioned or all(math.prod(shape) <= SMALL for shape in shapes):
            return (yield from super().exchange_segmented(flat, shapes, slots))
        density = self.density_at(slots[0])
        if len(shapes) == 1:  # a large tensor alone: the same selection without segments
            ks = [num_selected(flat.numel(), density)]
            indices, values = self.pick_by_threshold(flat, ks[0])
        else:
            key = (tuple(shapes), density)
            layout = self._threshold_layouts.get(key)
            if layout is None:
                layout = ThresholdSegments(shapes, density, self._threshold_stride)
                self._threshold_layouts[key] = layout
            offset = int(torch.randint(layout.offsets, (1,), generator=self.generator))
            indices, values = layout.pick(flat, offset)
            ks = layout.ks
        mean = yield from gather_sparse(values, indices, flat, slots[0].world_size)
        return Exchanged(mean=mean, local=None, sent_indices=indices, sent_counts=ks)

    def pick(self, flat: Tensor, k: int, slot: Slot) -> tuple[Tensor, Tensor]:
        """The ``k`` (index, value) pairs to send: :meth:`select`'s, or with the
        threshold selection :meth:`pick_by_threshold`'s."""
        if k < flat.numel() and self.by_threshold(flat.device):
            return self.pick_by_threshold(flat, k)
        return super().pick(flat, k, slot)

    def pick_by_threshold(self, flat: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """About ``k`` entries of ``flat`` at or above a sampled estimate of its k-th
        largest magnitude, with a fixed number of kernels and no value read back on the
        host: exactly ``k`` (index, value) pairs, padded with the first one's index and
        the value 0 when fewer pass the threshold (nothing is counted twice)."""
        n = flat.numel()
        stride = self._threshold_stride(k)
        offset = int(torch.randint(stride, (1,), generator=self.generator))
        self.last_candidates, self.last_tries = -1, 1
        if fused.available(flat.device):  # the same bits in fewer passes and kernels
            sample = flat[offset::stride].abs()
            aim = min(sample.numel(), aim_below(k * sample.numel() / n))
            threshold = torch.topk(sample, aim, sorted=False).values.min()
            passed = self._mask.take(n, torch.bool, flat.device)
            fused.mark_at_least(flat, threshold, passed)
            found_at = torch.nonzero_static(passed, size=k, fill_value=-1).view(-1)
            return fused.take_found(flat, found_at)
        magnitude, mask = self._buffers(flat)
        torch.abs(flat, out=magnitude)
        sample = magnitude[offset::stride]
        aim = min(sample.numel(), aim_below(k * sample.numel() / n))
        threshold = torch.topk(sample, aim, sorted=False).values.min()
        # above 0: a zero carries nothing (and a threshold of 0 would take every value)
        threshold = threshold.clamp_min(torch.finfo(flat.dtype).tiny)
        passed = mask[:n]
        torch.ge(magnitude, threshold, out=passed)
        found_at = torch.nonzero_static(passed, size=k, fill_value=-1).view(-1)
        found = found_at >= 0
        indices = torch.where(found, found_at, found_at[:1].clamp_min(0))
        values = torch.where(found, flat.index_select(0, indices), 0.0)
        return indices, values

    def _threshold_stride(self, k: int) -> int:
        """The sample stride of a threshold selection of ``k``: ``sample_fraction``'s,
        or a smaller one where that would leave fewer than :data:`MIN_AIM` sampled
        entries above the threshold (too few to place it: its count would scatter)."""
        stride = self._strides.get(k)
        if stride is None:
            stride = self.stride if k >= MIN_AIM * self.stride else _prime_at_least(k // MIN_AIM)
            self._strides[k] = stride
        return stride

    def select(self, flat: Tensor, k: int, slot: Slot) -> Tensor:
        """Flat indices of the ``k`` largest |flat|, via a threshold estimated on a sample."""
        n = flat.numel()
        if k >= n:
            self.last_candidates, self.last_tries = n, 0
            return torch.arange(n, device=flat.device)
        magnitude, mask = self._buffers(flat)
        torch.abs(flat, out=magnitude)
        offset = int(torch.randint(self.stride, (1,), generator=self.generator))
        sample = magnitude[offset :: self.stride]
        expected = k * sample.numel() / n  # sample entries expected above the true k-th
        aim = math.ceil(expected + self.margin_sigmas * math.sqrt(expected)) + 1
        self.last_tries = 0
        while self.last_tries < self.tries and aim < sample.numel():
            self.last_tries += 1
            threshold = torch.topk(sample, aim, sorted=False).values.min()
            if not threshold > 0:  # mostly zeros: a threshold cannot separate them
                break
            torch.ge(magnitude, threshold, out=mask[:n])
            candidates = nonzero_positions(mask, sparse=aim * 64 < sample.numel())
            self.last_candidates = candidates.numel()
            if candidates.numel() >= k:
                best = torch.topk(magnitude.index_select(0, candidates), k, sorted=False)
                return candidates.index_select(0, best.indices)
            aim = math.ceil(aim * 1.25 * k / max(candidates.numel(), 1)) + 1
        self.last_candidates = n
        return torch.topk(magnitude, k, sorted=False).indices

    def _buffers(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """|v| and mask buffers, reused across tensors and steps (grown when needed).

        Safe to share: the selection finishes with them before the protocol yields. The
        mask is padded to a multiple of 8 with ``False`` so it can be read as int64 words.
        """
        n = flat.numel()
        magnitude = self._magnitude.take(n, flat.dtype, flat.device)
        mask = self._mask.take(-(-n // 8) * 8, torch.bool, flat.device)
        mask[n:] = False  # the padding, which a longer tensor may have set
        return magnitude, mask

    # -- checkpointing --------------------------------------------------------------------

    #: on a step refused on the device the sample-offset generator moves on (every rank's
    #: alike): it picks the threshold's sample, not what the memory or the model holds
    undoes_on_device = True

    def state_dict(self) -> dict[str, Any]:
        """The state of the sample-offset generator."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sample-offset generator."""
        unknown = set(state) - {"generator"}
        if unknown:
            raise ValueError(f"compressor 'dgc' got unknown state {sorted(unknown)}")
        if "generator" in state:
            self.generator.set_state(state["generator"])


#: a threshold selection samples enough for at least this many sampled entries above the
#: threshold (the count it lets through then scatters about 1/sqrt(256) = 6 % around its
#: aim)
MIN_AIM = 256

#: DGC's ways of choosing a large tensor's entries (see ``DGC.selection``)
SELECTIONS = ("auto", "exact", "threshold")


def warmup_stages(density: float) -> list[float]:
    """The warm-up densities above ``density``: 0.25, 0.0625, 0.015625, 0.00390625, ..."""
    stages = []
    stage = WARMUP_START
    while stage > density:
        stages.append(stage)
        stage /= WARMUP_FACTOR
    return stages


def nonzero_positions(mask: Tensor, sparse: bool) -> Tensor:
    """Flat indices of the ``True`` entries of a bool mask whose length is a multiple of 8.

    A sparse mask is scanned eight bytes at a time: find the nonzero int64 words, then look
    only at the eight positions of each (about 3x faster than ``nonzero`` on the bytes).
    """
    if not sparse:
        return mask.nonzero().view(-1)
    words = mask.view(torch.int64).nonzero().view(-1)
    positions = (words.unsqueeze(1) * 8 + torch.arange(8, device=mask.device)).view(-1)
    return positions[mask.index_select(0, positions)]


def _prime_at_least(value: int) -> int:
    """The smallest prime >= ``value``: a sample stride that no row length is likely a
    multiple of, so strided samples do not keep hitting the same columns."""
    candidate = max(2, value)
    while any(candidate % d == 0 for d in range(2, math.isqrt(candidate) + 1)):
        candidate += 1
    return candidate
