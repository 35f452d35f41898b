"""The fused kernels of DGC's threshold selection give PyTorch's bits (Triton's interpreter
runs them on the CPU here; on a GPU they run compiled)."""

from __future__ import annotations

import math

import pytest
import torch

from thinwire.compress import Slot, fused, fused_segments
from thinwire.compress.dgc import DGC
from thinwire.compress.dgc_segments import ThresholdSegments

pytest.importorskip("triton", reason="the fused selection kernels need Triton (pip install triton)")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch):
    """The kernels run on CPU tensors through Triton's interpreter (which must have been
    asked for before Triton was imported: tests/conftest.py does where there is no GPU)."""
    if not fused.interpreting():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 is set only without a GPU)")
    monkeypatch.setattr(fused, "ON_CPU", True)
    fused._kernels.cache_clear()
    fused_segments._kernels.cache_clear()
    fused.forget_checks()
    assert fused.available(torch.device("cpu"))
    yield
    fused._kernels.cache_clear()
    fused_segments._kernels.cache_clear()
    fused.forget_checks()


def heavy_tailed(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Gradient-like values with exact zeros and ties, as a memory's accumulator has."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3
    values[torch.rand(n, generator=g) < 0.2] = 0.0
    values[:50] = 0.75  # ties at one magnitude
    values[50:100] = -0.75
    return values.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_mark_is_pytorchs_comparison(interpreted, dtype: torch.dtype) -> None:
    flat = heavy_tailed(5000, dtype)
    tiny = torch.finfo(dtype).tiny
    for t in (0.0, 0.5, 0.75, float(flat.abs().max())):
        threshold = torch.tensor(t, dtype=dtype)
        expected = flat.abs() >= threshold.clamp_min(tiny)
        assert torch.equal(fused.mark_at_least(flat, threshold), expected), t
    zeros = torch.zeros(10, dtype=dtype)
    assert not fused.mark_at_least(zeros, torch.tensor(0.0, dtype=dtype)).any()


def test_a_wrong_number_of_thresholds_is_refused(interpreted) -> None:
    with pytest.raises(ValueError, match="one threshold, got 3"):
        fused.mark_at_least(torch.ones(10), torch.ones(3))


def test_take_found_pads_as_the_selection_does(interpreted) -> None:
    flat = torch.arange(2000, dtype=torch.float32) - 1000.5
    found_at = torch.tensor([3, 17, 1999] + [-1] * 1500)
    indices, values = fused.take_found(flat, found_at)
    assert indices.dtype == torch.int64 and indices.shape == (1503,)
    assert indices[:3].tolist() == [3, 17, 1999] and (indices[3:] == 3).all()
    assert torch.equal(values[:3], flat[[3, 17, 1999]]) and (values[3:] == 0).all()
    indices, values = fused.take_found(flat, torch.full((5,), -1))  # nothing passed
    assert (indices == 0).all() and (values == 0).all()


def test_the_fused_threshold_selection_picks_the_same_pairs(interpreted, monkeypatch) -> None:
    """One large tensor over several steps: the same offsets, indices and values."""
    flat = heavy_tailed(200_000)
    slot = Slot("w", 10**6, 1)
    with_kernels = DGC(density=0.01, warmup_steps=0, selection="threshold", seed=3)
    without = DGC(density=0.01, warmup_steps=0, selection="threshold", seed=3)
    k = math.ceil(flat.numel() * 0.01)
    for step in range(3):
        fused_pairs = with_kernels.pick(flat, k, slot)
        with monkeypatch.context() as patch:
            patch.setattr(fused, "available", lambda device: False)
            eager_pairs = without.pick(flat, k, slot)
        for got, expected in zip(fused_pairs, eager_pairs, strict=True):
            assert torch.equal(got, expected), step
        flat = flat.roll(997)


def test_the_fused_segments_pick_the_same_pairs(interpreted, monkeypatch) -> None:
    shapes = [torch.Size([300, 40]), torch.Size([20_000]), torch.Size([64, 3, 3, 30])]
    flat = heavy_tailed(sum(math.prod(s) for s in shapes), seed=5)
    layout = ThresholdSegments(shapes, 0.01, lambda k: 7 if k >= 256 * 7 else 3)
    for offset in range(layout.offsets):
        fused_pairs = layout.pick(flat, offset)
        with monkeypatch.context() as patch:
            patch.setattr(fused, "available", lambda device: False)
            eager_pairs = layout.pick(flat, offset)
        for got, expected in zip(fused_pairs, eager_pairs, strict=True):
            assert torch.equal(got, expected), offset


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and Triton)")
def test_on_a_gpu_the_fused_selection_picks_pytorchs_pairs(monkeypatch) -> None:
    """Compiled for the GPU, the kernels give the bits of PyTorch's operations there."""
    fused._kernels.cache_clear()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    device = torch.device("cuda")
    assert fused.available(device)
    flat = heavy_tailed(3_000_000).to(device)
    slot = Slot("w", 10**6, 1)
    k = math.ceil(flat.numel() * 0.001)
    with_kernels = DGC(density=0.001, warmup_steps=0, selection="threshold", seed=3)
    without = DGC(density=0.001, warmup_steps=0, selection="threshold", seed=3)
    fused_pairs = with_kernels.pick(flat, k, slot)
    monkeypatch.setattr(fused, "available", lambda device: False)
    eager_pairs = without.pick(flat, k, slot)
    for got, expected in zip(fused_pairs, eager_pairs, strict=True):
        assert torch.equal(got, expected)
    fused._kernels.cache_clear()


def reference_pick(flat: torch.Tensor, thresholds: list[float], sizes: list[int], ks: list[int]):
    """Each segment's first k passes in order, empty slots padded with its first kept
    index (its start if none) and the value 0: what the segments' selection sends."""
    indices, values, start = [], [], 0
    tiny = torch.finfo(flat.dtype).tiny
    for t, size, k in zip(thresholds, sizes, ks, strict=True):
        part = flat[start : start + size]
        passed = (part.abs() >= max(t, tiny)).nonzero().view(-1)[:k] + start
        pad = int(passed[0]) if passed.numel() else start
        chosen = torch.cat([passed, torch.full((k - passed.numel(),), pad)])
        indices.append(chosen)
        values.append(torch.where(torch.arange(k) < passed.numel(), flat[chosen], 0.0))
        start += size
    return torch.cat(indices), torch.cat(values)


def test_the_segment_kernels_keep_the_first_k_passes_in_order(interpreted) -> None:
    """Segments with more passes than k (most values pass), fewer, and none; sizes
    across several blocks and below one."""
    sizes, ks = [5000, 700, 3000, 2500], [40, 10, 3000, 7]
    flat = heavy_tailed(sum(sizes), seed=9)
    flat[5700:8700] = 0.0  # the third segment: nothing passes
    tables = fused_segments.SegmentTables(sizes, ks)
    for thresholds in ([0.0, 0.0, 0.0, 0.0], [0.3, 2.5, 0.1, 5.0], [0.75, 0.01, 0.0, 0.2]):
        got = fused_segments.pick_segments(flat, torch.tensor(thresholds), tables)
        expected = reference_pick(flat, thresholds, sizes, ks)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b), thresholds


def test_kernels_that_fail_to_build_leave_pytorchs_operations(interpreted, monkeypatch) -> None:
    """A device where Triton cannot build or run them (no compiler, an unsupported GPU):
    one warning, and the selection goes on with PyTorch's operations."""
    fused.forget_checks()

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(fused, "take_found", broken)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        assert not fused.available(torch.device("cpu"))
    assert not fused.available(torch.device("cpu"))  # checked once: no second warning
    flat = heavy_tailed(200_000)
    dgc = DGC(density=0.01, warmup_steps=0, selection="threshold")
    indices, values = dgc.pick(flat, 2000, Slot("w", 10**6, 1))  # PyTorch's path
    assert indices.shape == (2000,) and bool((values != 0).any())
