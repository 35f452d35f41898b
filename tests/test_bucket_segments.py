"""Tensors side by side as segments decode, select and keep entries as each tensor alone would."""

from __future__ import annotations

import pytest
import torch

import thinwire
from thinwire.comm.runs import group_runs
from thinwire.compress.base import Slot, run_locally

SMALL_SHAPES = [(70, 64), (3,), (8, 8), (1, 200), (5, 4, 16)]
#: tensors a GPU takes as segments too (``Compressor.large_segments_off_cpu``)
LARGE_SHAPES = [(300, 300), (3, 70_000), (256, 32, 3, 3)]


@pytest.mark.parametrize("shapes", [SMALL_SHAPES, LARGE_SHAPES], ids=["small", "large"])
@pytest.mark.parametrize(
    ("name", "options"),
    [("onebit", {}), ("onebit", {"per_row": False}), ("signsgd", {})],
)
def test_segments_decode_as_each_tensor_alone(name: str, options: dict, shapes: list) -> None:
    """Tensors side by side as segments: every tensor's mean and what it sent equal its
    exchange alone (scales per tensor or per row, as alone), in one world."""
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(shape, generator=gen) for shape in shapes]
    slots = [Slot(f"t{i}", 0, world_size=1) for i in range(len(grads))]
    alone = [
        run_locally(thinwire.compressor(name, **options).exchange(g, s))
        for g, s in zip(grads, slots, strict=True)
    ]
    flat = torch.cat([g.reshape(-1) for g in grads])
    compressor = thinwire.compressor(name, **options)
    sent: list[int] = []
    together = run_locally(
        compressor.exchange_segmented(flat, [g.shape for g in grads], slots), sent
    )
    offset = 0
    for grad, result in zip(grads, alone, strict=True):
        part = slice(offset, offset + grad.numel())
        offset += grad.numel()
        # the scales are fp32 sums taken in another order: equal to rounding (64 values)
        close = torch.testing.assert_close
        close(together.mean[part].view(grad.shape), result.mean, rtol=1e-5, atol=1e-7)
        close(together.local[part].view(grad.shape), result.local, rtol=1e-5, atol=1e-7)
        assert torch.equal(together.mean[part].view(grad.shape) > 0, result.mean > 0)
    # one packed sign per value: a byte for every 8 values and 4 bytes per scale
    rows = sum(shape[0] if len(shape) > 1 else 1 for shape in shapes)
    assert sent[0] <= flat.numel() // 8 + 1 + 8 * rows


@pytest.mark.parametrize("name", ["terngrad", "qsgd"])
def test_stochastic_segments_are_unbiased_and_on_their_grid(name: str) -> None:
    """Small tensors side by side: each value decodes to one of its segment's levels, and
    over many draws the decodes average to what each tensor alone would (clipped for
    TernGrad)."""
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(shape, generator=gen) for shape in SMALL_SHAPES]
    flat = torch.cat([g.reshape(-1) for g in grads])
    shapes = [g.shape for g in grads]
    slots = [Slot(f"t{i}", 0, world_size=1) for i in range(len(grads))]
    compressor = thinwire.compressor(name, seed=3)
    draws = 400
    total = torch.zeros_like(flat)
    for _ in range(draws):
        result = run_locally(compressor.exchange_segmented(flat, shapes, slots))
        assert torch.equal(result.mean, result.local)  # one rank: the mean is its own
        total += result.local
    average = total / draws
    offset = 0
    for grad in grads:
        part = slice(offset, offset + grad.numel())
        offset += grad.numel()
        if name == "terngrad":
            rows = grad.shape[0] if grad.dim() > 1 and grad[0].numel() >= 64 else 1
            matrix = grad.reshape(rows, -1)
            rms = matrix.square().mean(1, keepdim=True).sqrt()
            expected = torch.maximum(torch.minimum(matrix, 2.5 * rms), -2.5 * rms)
            scale = expected.abs().amax(1, keepdim=True)  # s of each row: values are 0 or +-s
            seen = result.local[part].view(rows, -1)
            assert bool(((seen.abs() == 0) | torch.isclose(seen.abs(), scale)).all())
            spread = scale.expand_as(matrix)
        else:
            norm = grad.norm()
            expected = grad.reshape(1, -1)
            levels = result.local[part] / norm * 7
            assert torch.allclose(levels, levels.round(), atol=1e-4)
            spread = (norm / 7).expand_as(expected)
        # each draw's error is at most one level: 6 standard errors of the average
        bound = 6 * spread / (2 * draws**0.5)
        assert bool(((average[part].view_as(expected) - expected).abs() <= bound).all())


@pytest.mark.parametrize(
    "shapes",
    [
        [(30, 20), (7, 9), (64, 64)],
        [(32, 32), (32, 32), (32, 32)],
        [(16, 16), (16,), (16, 16), (16,), (7, 9), (16, 16)],
    ],
    # one size: no padding, one k: no sort (the fast path); interleaved: the CPU takes
    # each size's tensors together, gathered from between the others, and puts them back
    ids=["sizes-apart", "one-size", "interleaved"],
)
@pytest.mark.parametrize("name", ["topk", "dgc"])
def test_sparse_segments_send_each_tensors_own_top_k(name: str, shapes: list) -> None:
    """Small matrices side by side: every tensor sends exactly its own top-k entries (as
    alone), and the sent indices come back to each tensor in its own numbering."""
    from thinwire.comm.runs import split_flat

    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(shape, generator=gen) for shape in shapes]
    flat = torch.cat([g.reshape(-1) for g in grads])
    slots = [Slot(f"t{i}", 5000, world_size=1) for i in range(len(grads))]
    compressor = thinwire.compressor(name, density=0.05)
    together = run_locally(compressor.exchange_segmented(flat, [g.shape for g in grads], slots))
    pieces = split_flat(grads)(together)
    for grad, piece in zip(grads, pieces, strict=True):
        k = max(1, round(grad.numel() * 0.05))
        expected = torch.topk(grad.reshape(-1).abs(), k).indices
        assert sorted(piece.sent_indices.tolist()) == sorted(expected.tolist())
        dense = torch.zeros(grad.numel())
        dense[expected] = grad.reshape(-1)[expected]
        assert torch.equal(piece.mean.reshape(-1), dense)  # one rank: what it sent


@pytest.mark.parametrize(
    "shapes",
    [
        [(16, 16), (16,), (16, 16), (16,), (7, 9), (16, 16)],  # sizes interleaved
        [(8, 8), (8, 8), (3,), (3,), (40,)],  # each size's tensors one after another
        [(5, 5), (2, 2)],  # one tensor per size
    ],
)
def test_segmented_top_k_by_size_equals_the_padded_matrix(shapes: list) -> None:
    """The CPU's way (each size's tensors together) and the padded matrix's (a GPU's)
    select the same entries in the same order of tensors, each tensor's own top k."""
    from thinwire.compress.topk import SegmentedTopK

    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(shape, generator=gen) for shape in shapes]
    flat = torch.cat([g.reshape(-1) for g in grads])
    layout = SegmentedTopK([g.shape for g in grads], 0.1)
    by_size, padded = layout.select(flat), layout.select(flat, padded=True)
    offset, start = 0, 0
    for grad, k in zip(grads, layout.ks, strict=True):
        own = torch.topk(grad.reshape(-1).abs(), k).indices + offset
        for chosen in (by_size, padded):
            assert sorted(chosen[start : start + k].tolist()) == sorted(own.tolist())
        offset, start = offset + grad.numel(), start + k
    assert start == by_size.numel() == padded.numel()


def test_randomk_segments_keep_k_shared_uniform_entries_per_tensor() -> None:
    """Side by side: each tensor keeps exactly its k entries, the same on every rank (the
    same seed, keys and step), each entry about k/n of the steps."""
    from thinwire.comm.runs import split_flat

    shapes = [torch.Size((20, 10)), torch.Size((4, 25))]
    flat = torch.randn(300, generator=torch.Generator().manual_seed(2))
    like = [flat[:200].view(20, 10), flat[200:].view(4, 25)]
    kept = torch.zeros(300)
    steps = 400
    for step in range(steps):
        slots = [Slot(f"t{i}", step, world_size=1) for i in range(2)]
        results = [
            run_locally(
                thinwire.compressor("randomk", density=0.1).exchange_segmented(flat, shapes, slots)
            )
            for _ in range(2)  # two "ranks"
        ]
        assert torch.equal(results[0].sent_indices, results[1].sent_indices)
        pieces = split_flat(like)(results[0])
        assert [p.sent_indices.numel() for p in pieces] == [20, 10]
        kept[results[0].sent_indices] += 1
    frequency = kept / steps  # 0.1 each; a binomial's 6 standard deviations around it
    assert bool(((frequency - 0.1).abs() < 6 * (0.1 * 0.9 / steps) ** 0.5).all())


def test_segments_reduce_and_expand_as_each_segment_alone() -> None:
    from thinwire.compress.segments import Segments

    lengths = [5, 1, 64, 3]
    values = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(1))
    segments = Segments(lengths)
    parts = values.split(lengths)
    torch.testing.assert_close(segments.sums(values), torch.stack([p.sum() for p in parts]))
    assert torch.equal(segments.max(values), torch.stack([p.max() for p in parts]))
    expanded = segments.expand(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(
        expanded, torch.repeat_interleave(torch.arange(1.0, 5.0), torch.tensor(lengths))
    )
    with pytest.raises(ValueError, match="lengths >= 1"):
        Segments([3, 0])


def test_a_small_segment_keeps_its_sum_beside_large_ones() -> None:
    """A running sum's differences lost a tiny segment beside large ones (on a GPU they
    came out negative, and TernGrad's square root made its bound NaN)."""
    from thinwire.compress.segments import Segments

    values = torch.cat([torch.full((1000,), 1e8), torch.full((5,), 1e-6), torch.full((3,), 1e8)])
    sums = Segments([1000, 5, 3]).sums(values.square())
    torch.testing.assert_close(sums[1], torch.tensor(5e-12), rtol=1e-6, atol=0.0)


def test_randomk_segments_keep_the_same_entries_whatever_the_bucket_layout() -> None:
    """DDP lays its buckets out anew after the first step, and a resumed run starts from
    the first layout again: each tensor's kept entries must not depend on its place."""
    from thinwire.comm.runs import split_flat

    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(20, 10, generator=gen), torch.randn(4, 25, generator=gen)

    def kept(order: list[tuple[str, torch.Tensor]]) -> dict[str, list[int]]:
        flat = torch.cat([t.reshape(-1) for _, t in order])
        slots = [Slot(key, 7, world_size=1) for key, _ in order]
        compressor = thinwire.compressor("randomk", density=0.1)
        result = run_locally(
            compressor.exchange_segmented(flat, [t.shape for _, t in order], slots)
        )
        pieces = split_flat([t for _, t in order])(result)
        return {key: sorted(p.sent_indices.tolist()) for (key, _), p in zip(order, pieces)}

    assert kept([("a", a), ("b", b)]) == kept([("b", b), ("a", a)])


def test_randomk_keeps_a_small_tensors_entries_alone_or_side_by_side() -> None:
    """The parameter server exchanges tensors one by one, the optimizer wrapper side by
    side: a small tensor must keep the same entries either way."""
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(20, 10, generator=gen), torch.randn(4, 25, generator=gen)
    compressor = thinwire.compressor("randomk", density=0.1)
    slots = [Slot("a", 3, world_size=1), Slot("b", 3, world_size=1)]
    flat = torch.cat([a.reshape(-1), b.reshape(-1)])
    together = run_locally(compressor.exchange_segmented(flat, [a.shape, b.shape], slots))
    from thinwire.comm.runs import split_flat

    pieces = split_flat([a, b])(together)
    for tensor, slot, piece in zip((a, b), slots, pieces, strict=True):
        alone = run_locally(compressor.exchange(tensor, slot))
        assert sorted(piece.sent_indices.tolist()) == alone.sent_indices.tolist()
        assert torch.equal(piece.mean.reshape(tensor.shape), alone.mean)


@pytest.mark.parametrize("name", ["onebit", "signsgd", "terngrad", "qsgd", "dgc", "topk"])
def test_large_tensors_go_as_segments_off_the_cpu_only(name: str) -> None:
    """Off the CPU a quantizer takes a bucket's large tensors as one run of segments (a
    fixed number of kernels); on the CPU each alone (its chunked path). DGC's threshold
    selection does so off the CPU too; top-k keeps large tensors alone everywhere."""
    compressor = thinwire.compressor(name)
    shapes = [torch.Size(s) for s in [*LARGE_SHAPES, (8, 8)]]
    for device, expect in [("cpu", False), ("meta", name != "topk")]:
        kinds = [(shape, (torch.float32, torch.device(device))) for shape in shapes]
        groups = group_runs(kinds, [True] * len(shapes), compressor)
        large = [g for g in groups if g.members[0] < len(LARGE_SHAPES)]
        if expect:
            assert [(g.members, g.how) for g in large] == [([0, 1, 2], "segments")], groups
        else:
            assert all(g.how == "alone" for g in large) and len(large) == 3, groups
    if name in ("onebit", "signsgd", "terngrad", "qsgd"):  # deterministic: each alone
        torch.use_deterministic_algorithms(True)
        try:
            assert not compressor.segments_large(torch.device("meta"))
        finally:
            torch.use_deterministic_algorithms(False)
