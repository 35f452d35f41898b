"""A bucket in runs computes what one protocol per tensor did: grouping, PowerSGD, memories."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import thinwire
from thinwire.comm.runs import flatten, plan_runs, side_by_side
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
