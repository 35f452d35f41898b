"""A bucket exchanged in runs (side by side, stacked, alone) computes what one protocol per
tensor computed: the grouping, zero-copy flattening, finiteness naming, PowerSGD stacked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import thinwire
from thinwire.comm.runs import flatten, group_runs, plan_runs, side_by_side
from thinwire.compress.base import Slot, run_locally
from thinwire.compress.finite import FiniteChecks
from thinwire.compress.powersgd import PowerSGD


def _bucket(shapes: list[tuple[int, ...]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A flat buffer and views of it shaped as ``shapes``, as DDP's bucket hands them."""
    sizes = [int(np.prod(s)) for s in shapes]
    buffer = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(0))
    views, offset = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        views.append(buffer[offset : offset + size].view(shape))
        offset += size
    return buffer, views


def test_side_by_side_views_flatten_without_a_copy() -> None:
    buffer, views = _bucket([(4, 3), (3,), (2, 2, 2)])
    flat = side_by_side(views)
    assert flat is not None and flat.data_ptr() == buffer.data_ptr()
    assert torch.equal(flat, buffer)
    # tensors that do not lie side by side are copied, values in order
    apart = [views[0], views[2]]  # a gap where views[1] lies
    assert side_by_side(apart) is None
    assert torch.equal(flatten(apart), torch.cat([views[0].reshape(-1), views[2].reshape(-1)]))
    assert side_by_side([views[0].T]) is None  # not contiguous
    assert side_by_side([views[1], views[0]]) is None  # out of order


def test_runs_group_dense_side_by_side_and_stack_same_shapes() -> None:
    _, views = _bucket([(8, 8), (8,), (8, 8), (4, 8), (8,)])
    compressor = PowerSGD(rank=1, min_compression=0.0)
    compressed = [compressor.compresses(v) for v in views]
    assert compressed == [True, False, True, True, False]
    planned = plan_runs(views, compressed, compressor)
    groups = [(p.members, p.compressed, tuple(p.tensor.shape)) for p in planned]
    assert groups == [([1, 4], False, (16,)), ([0, 2], True, (2, 8, 8)), ([3], True, (4, 8))]
    # none: one flat run over the whole bucket, a view of the buffer
    none = thinwire.compressor("none")
    (whole,) = plan_runs(views, [True] * 5, none)
    assert whole.members == [0, 1, 2, 3, 4] and whole.tensor.data_ptr() == views[0].data_ptr()


def test_a_non_finite_tensor_checked_together_is_named_alone() -> None:
    _, views = _bucket([(3, 3), (5,), (2, 4)])
    views[1][2] = float("nan")
    checks = FiniteChecks()
    flat = side_by_side(views)
    assert flat is not None
    checks.add_together([7, 8, 9], flat, lambda: views)
    assert checks.failed() == [8]
    clean = FiniteChecks()
    clean.add_together([0, 1], views[0], lambda: [views[0][:1], views[0][1:]])
    assert clean.failed() == []


def test_powersgd_stacked_equals_one_by_one_over_steps() -> None:
    """Three steps with warm starts carried: the stacked exchange's means, what it sent
    and the next warm start match the per-tensor exchange's to fp32 rounding."""
    gen = torch.Generator().manual_seed(5)
    keys = ["a", "b", "c"]
    one_by_one, stacked = PowerSGD(rank=2), PowerSGD(rank=2)
    for step in range(3):
        grads = [torch.randn(16, 12, generator=gen) for _ in keys]
        slots = [Slot(key, step, world_size=1) for key in keys]
        alone = [run_locally(one_by_one.exchange(g, s)) for g, s in zip(grads, slots, strict=True)]
        together = run_locally(stacked.exchange_stacked(torch.stack(grads), slots))
        for i, result in enumerate(alone):
            torch.testing.assert_close(together.mean[i], result.mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(together.local[i], result.local, rtol=1e-5, atol=1e-6)
        for key in keys:
            torch.testing.assert_close(
                stacked.warm[key], one_by_one.warm[key], rtol=1e-5, atol=1e-6
            )
    # its checkpoint is keyed by tensor as before, and loads into a one-by-one instance
    restored = PowerSGD(rank=2)
    restored.load_state_dict(stacked.state_dict())
    assert sorted(restored.warm) == keys


def _train_powersgd(rank: int, world: int, stacked: bool) -> list[np.ndarray]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Linear(12, 3))
    compressor = PowerSGD(rank=2)
    if not stacked:
        compressor.batches = False  # the instance runs one protocol per tensor, as before
    opt = thinwire.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, compressor
    )
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 12, generator=gen)).square().mean().backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def train_both_ways(rank: int, world: int) -> float:
    """Largest relative difference between the weights trained stacked and one by one."""
    ours = _train_powersgd(rank, world, stacked=True)
    before = _train_powersgd(rank, world, stacked=False)
    return max(float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12)) for a, b in zip(ours, before))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_powersgd_trains_the_same_stacked_as_one_by_one(pool2) -> None:
    assert max(pool2.run(train_both_ways)) < 1e-5


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


@pytest.mark.parametrize("memory_kind", ["residual", "dgc", "dgc-masking"])
def test_memories_compensate_a_bucket_as_one_tensor_at_a_time(memory_kind: str) -> None:
    """The multi-tensor compensate and update give the same bits as the loop."""
    from thinwire.compress.base import Exchanged
    from thinwire.compress.feedback import DGCMemory, ResidualMemory

    def make() -> object:
        if memory_kind == "residual":
            return ResidualMemory()
        return DGCMemory(momentum=0.9, weight_decay=0.01, masking=memory_kind == "dgc-masking")

    gen = torch.Generator().manual_seed(8)
    params = [torch.randn(shape, generator=gen) for shape in [(5, 4), (3,), (2, 2, 2)]]
    batched, looped = make(), make()
    for step in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        slots = [Slot(f"p{i}", step, world_size=2) for i in range(len(grads))]
        ours = batched.compensate_many(grads, slots, params)
        theirs = [looped.compensate(g, s, p) for g, s, p in zip(grads, slots, params)]
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)
        sent = [Exchanged(mean=c * 0.5, local=c * 0.5) for c in theirs]
        sent[1] = Exchanged(mean=theirs[1], local=None, sent_indices=torch.tensor([0, 2]))
        batched.update_many(ours, sent, slots, compressed=True)
        for c, s, slot in zip(theirs, sent, slots, strict=True):
            looped.update(c, s, slot, compressed=True)
        batched.commit()
        looped.commit()
    for key, tensors in looped.state_dict().items():
        for name, tensor in tensors.items():
            assert torch.equal(batched.state_dict()[key][name], tensor)


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


def test_a_whole_bucket_with_an_empty_tensor_still_goes_through_the_compressor() -> None:
    """fp16 over a DDP bucket holding an empty parameter: the bucket went whole through
    the dense fallback (fp32) because one member was not compressed."""
    buffer, views = _bucket([(4, 3), (3,)])
    empty = buffer[:0].view(0, 5)
    correcteds = [views[0], empty, views[1]]
    fp16 = thinwire.compressor("fp16")
    planned = plan_runs(correcteds, [True, False, True], fp16, whole=buffer)
    assert [p.compressed for p in planned if p.tensor.numel()] == [True]
    everything = plan_runs([views[0], views[1]], [True, True], fp16, whole=buffer)
    assert len(everything) == 1 and everything[0].compressed
    assert everything[0].tensor is buffer


@pytest.mark.parametrize("memory_kind", ["residual", "dgc", "dgc-masking", "dgc-decay"])
def test_a_memory_laid_out_by_run_keeps_the_same_bits(memory_kind: str) -> None:
    """A memory holding a run's buffers side by side (``arrange``) compensates to one
    flat tensor without a copy, in a few operations over the whole run (its gradients
    copied in side by side; with DGC's weight decay, per tensor), and zeroes the run's
    sent entries in one operation, with the same bits as a memory holding each tensor
    alone, through a refused step and a state loaded from the other."""
    from thinwire.compress.base import Exchanged, RunUpdate
    from thinwire.compress.feedback import DGCMemory, ResidualMemory

    def make() -> object:
        if memory_kind == "residual":
            return ResidualMemory()
        decay = 0.01 if memory_kind == "dgc-decay" else 0.0
        return DGCMemory(momentum=0.9, weight_decay=decay, masking=memory_kind == "dgc-masking")

    gen = torch.Generator().manual_seed(3)
    shapes = [(5, 4), (7,), (2, 3, 2)]
    params = [torch.randn(shape, generator=gen) for shape in shapes]
    keys = [f"p{i}" for i in range(len(shapes))]
    arranged, alone = make(), make()
    together = []  # steps whose run was compensated as one
    begin_flat = arranged._buffers.begin_flat

    def spy(*args: object) -> object:
        begun = begin_flat(*args)
        together.append(begun is not None)
        return begun

    arranged._buffers.begin_flat = spy
    for step in range(6):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        slots = [Slot(key, step, world_size=2) for key in keys]
        arranged.arrange(keys, grads)
        ours = arranged.compensate_many(grads, slots, params, [[0, 1, 2]])
        theirs = alone.compensate_many(grads, slots, params)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        assert side_by_side(ours) is not None  # laid out: a run's tensor is a view
        assert step == 0 or side_by_side(theirs) is None
        counts = [2, 1, 3]
        own = [torch.randperm(t.numel(), generator=gen)[:k] for t, k in zip(ours, counts)]
        starts = [0, 20, 27]
        outcome = Exchanged(
            mean=torch.zeros(39),
            local=None,
            sent_indices=torch.cat([i + s for i, s in zip(own, starts, strict=True)]),
            sent_counts=counts,
        )

        def split() -> list:
            raise AssertionError("a run laid out side by side was split per tensor")

        arranged.update_runs([RunUpdate(ours, outcome, split, slots, True)])
        per_tensor = [Exchanged(mean=t, local=None, sent_indices=i) for t, i in zip(theirs, own)]
        alone.update_many(theirs, per_tensor, slots, compressed=True)
        if step == 2:  # refused
            arranged.rollback()
            alone.rollback()
        else:
            arranged.commit()
            alone.commit()
        if step == 4:  # a checkpoint of the other memory, loaded
            arranged.load_state_dict(alone.state_dict())
        for name, tensors in alone.state_dict().items():
            for key, tensor in tensors.items():
                assert torch.equal(arranged.state_dict()[name][key], tensor), (step, key)
    # laid out at the first step, again after the load; with weight decay, never as one
    expected = [] if memory_kind == "dgc-decay" else [True] * 6
    assert together == expected


def test_a_memory_compensates_its_groups_as_one_and_the_rest_per_tensor() -> None:
    """Groups of a bucket's tensors laid out apart (not in the bucket's order, one
    tensor in none) compensate as one each, the rest per tensor: the same bits as alone."""
    from thinwire.compress.feedback import DGCMemory, ResidualMemory

    gen = torch.Generator().manual_seed(5)
    shapes = [(4, 4), (3,), (2, 5), (6,), (3, 3)]
    keys = [f"p{i}" for i in range(len(shapes))]
    groups = [[4, 0], [1, 3]]
    for make in (ResidualMemory, lambda: DGCMemory(momentum=0.5)):
        arranged, alone = make(), make()
        for step in range(3):
            grads = [torch.randn(shape, generator=gen) for shape in shapes]
            slots = [Slot(key, step, world_size=1) for key in keys]
            for group in groups:
                arranged.arrange([keys[i] for i in group], [grads[i] for i in group])
            ours = arranged.compensate_many(grads, slots, [None] * 5, groups)
            theirs = alone.compensate_many(grads, slots, [None] * 5)
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
            if step > 0:  # laid out by then: a group's tensors are views of one block
                assert side_by_side([ours[4], ours[0]]) is not None
                assert side_by_side([ours[1], ours[3]]) is not None
            for c in ours:
                c.mul_(0.5)  # half of each kept, as if half had been sent
            arranged.commit()
            for c in theirs:
                c.mul_(0.5)
            alone.commit()


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


def test_a_kept_bucket_is_surveyed_once_and_not_kept_alive() -> None:
    """The engine surveys a list the caller keeps (a DDP hook's bucket) once, and holds it
    only weakly: when DDP rebuilds its buckets, the old buffer must be freed."""
    import gc
    import weakref

    from thinwire.comm import GradientItem
    from thinwire.comm.survey import KeptItems, Surveys

    surveys = Surveys(thinwire.compressor("topk", density=0.5))
    buffer = torch.zeros(30)
    items = KeptItems([GradientItem("w", buffer[:20].view(4, 5)), GradientItem("b", buffer[20:])])
    first = surveys.of(items)
    assert surveys.of(items) is first  # the same kept list: the same survey
    assert surveys.of(list(items)) is not first  # any other list: surveyed anew
    assert (first.keys, first.sizes, first.total) == (["w", "b"], [20, 10], 30)
    assert first.compressed == [True, False]  # top-k sends a 1-D tensor dense
    slots = first.slots(3, 2, 1)
    assert slots[1] == Slot("b", 3, 2, 1) and first.slots(3, 2, 1) is slots
    gone = weakref.ref(buffer)
    del items, buffer
    gc.collect()
    assert gone() is None  # the survey kept neither the items nor their gradients


def test_a_group_whose_blocks_changed_is_not_begun_as_one() -> None:
    """``begin_flat`` begins nothing where a key's buffers are no longer the group's
    blocks (the per-tensor way then begins it as usual, from the state committed)."""
    from thinwire.compress.step_buffers import StepBuffers

    likes = [torch.zeros(3), torch.zeros(2, 2)]
    buffers = StepBuffers(1)
    buffers.arrange(["a", "b"], likes)
    _, _, (new,) = buffers.begin_flat(["a", "b"], likes)
    new.copy_(torch.arange(7.0))
    buffers.commit()
    assert torch.equal(buffers.kept["b"][0].reshape(-1), torch.arange(3.0, 7.0))
    buffers._spare.pop("b")  # as if b's spare buffer had been dropped
    assert buffers.begin_flat(["a", "b"], likes) is None
    assert not buffers._pending  # nothing begun
    (kept_b,), _ = buffers.begin("b", likes[1])
    assert torch.equal(kept_b.reshape(-1), torch.arange(3.0, 7.0))  # the committed state
