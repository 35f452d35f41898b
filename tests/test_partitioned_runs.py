"""The partitioned exchange of a bucket's tensors as one protocol (issue 29): the same
means, applied indices and rounds, bit for bit, as each tensor's own protocol (and as
gathering, for the tensors where partitioning does not pay), over steps that move the
window and re-balance the partitions; ranks simulated in one process."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from thinwire.compress import Slot
from thinwire.compress.base import num_selected
from thinwire.compress.dgc import DGC
from thinwire.compress.partitioned import partition_pays
from thinwire.compress.simulated import drive_ranks
from thinwire.compress.topk import TopK

#: a partitioned tensor, a small one gathered between two partitioned ones, another
#: partitioned one, a small one gathered at the end
SHAPES = [torch.Size([64, 512]), torch.Size([4, 6]), torch.Size([128, 96]), torch.Size([3, 7])]


def _gradients(world: int, seed: int) -> list[list[Tensor]]:
    """Per rank, a gradient of each shape: shared large entries plus noise (no ties)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[list[Tensor]] = [[] for _ in range(world)]
    for shape in SHAPES:
        common = torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < 0.05)
        for rank in range(world):
            out[rank].append(common * 3 + torch.randn(shape, generator=gen))
    return out


def _counted(protocol, rounds: list[int]):
    """``protocol``, counting the requests it makes."""
    answer = None
    try:
        while True:
            request = protocol.send(answer)
            rounds.append(1)
            answer = yield request
    except StopIteration as stop:
        return stop.value


def _one_by_one(comps: Sequence[TopK], grads: list[list[Tensor]], step: int):
    """Each tensor through its own protocol: per tensor, every rank's outcome; rounds."""
    world, outcomes, rounds = len(grads), [], 0
    for t, _ in enumerate(SHAPES):
        counted: list[int] = []
        protocols = [
            _counted(
                comp.exchange(grads[r][t], Slot(f"t{t}", step, world, r)),
                counted if r == 0 else [],
            )
            for r, comp in enumerate(comps)
        ]
        results, _ = drive_ranks(protocols)
        outcomes.append(results)
        rounds = max(rounds, len(counted))
    return outcomes, rounds


def _as_one(comps: Sequence[TopK], grads: list[list[Tensor]], step: int):
    """The tensors side by side, one protocol per rank: every rank's outcome; rounds."""
    world, counted = len(grads), []
    protocols = []
    for r, comp in enumerate(comps):
        flat = torch.cat([g.reshape(-1) for g in grads[r]])
        slots = [Slot(f"t{t}", step, world, r) for t in range(len(SHAPES))]
        protocol = comp.exchange_segmented(flat, SHAPES, slots)
        protocols.append(_counted(protocol, counted if r == 0 else []))
    results, sent = drive_ranks(protocols)
    return results, len(counted), sent


def _per_tensor(flat: Tensor, sent: Tensor, counts: Sequence[int]) -> list[tuple]:
    """A run's outcome as per tensor (mean, sorted sent indices of its own)."""
    means = flat.split([s.numel() for s in SHAPES])
    out, start, at = [], 0, 0
    for mean, shape, count in zip(means, SHAPES, counts, strict=True):
        mine = sent[at : at + count] - start
        out.append((mean.view(shape), torch.sort(mine).values))
        start, at = start + shape.numel(), at + count
    return out


@pytest.mark.parametrize("world", [4, 16])
@pytest.mark.parametrize("kind", ["topk", "dgc", "dgc-threshold"])
def test_a_run_exchanges_what_each_tensor_would_alone_over_steps(world: int, kind: str) -> None:
    def make() -> TopK:
        if kind.startswith("dgc"):  # the threshold selection (a GPU's) pads with repeats
            selection = "threshold" if kind == "dgc-threshold" else "exact"
            return DGC(density=0.02, partitioned=True, warmup_steps=0, rebalance_every=2,
                       selection=selection)  # fmt: skip
        return TopK(density=0.02, partitioned=True, rebalance_every=2)

    alone, together = [make() for _ in range(world)], [make() for _ in range(world)]
    paying = [partition_pays(num_selected(s.numel(), 0.02), world) for s in SHAPES]
    assert paying == [True, False, True, False]  # both paths, interleaved
    for step in range(5):  # the first step's radix rounds, then the window; re-balanced
        grads = _gradients(world, seed=step)
        expected, rounds_alone = _one_by_one(alone, grads, step)
        results, rounds, _ = _as_one(together, grads, step)
        assert rounds == rounds_alone
        for rank, result in enumerate(results):
            got = _per_tensor(result.mean, result.sent_indices, result.sent_counts)
            for t, (mean, sent) in enumerate(got):
                own = expected[t][rank]
                assert torch.equal(mean, own.mean), (step, rank, t)
                assert torch.equal(sent, torch.sort(own.sent_indices).values), (step, rank, t)
        for a, b in zip(alone, together, strict=True):  # the same windows, the same ranges
            for t, size in ((0, SHAPES[0].numel()), (2, SHAPES[2].numel())):
                key = f"t{t}"
                assert a._partitions.threshold_hint(key) == b._partitions.threshold_hint(key)
                assert torch.equal(
                    a._partitions.bounds(key, size, world), b._partitions.bounds(key, size, world)
                )
    equal = torch.div(torch.arange(world + 1) * SHAPES[0].numel(), world, rounding_mode="floor")
    moved = together[0]._partitions.bounds("t0", SHAPES[0].numel(), world)
    assert not torch.equal(moved, equal)  # the re-balancing ran


def test_a_run_with_nothing_worth_partitioning_is_gathered_as_each_tensor_alone() -> None:
    world = 16  # k of 2 and 1: gathering sends less
    shapes = [torch.Size([8, 16]), torch.Size([5, 9])]
    comps = [TopK(density=0.02, partitioned=True) for _ in range(world)]
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(world)]
    protocols = [
        comp.exchange_segmented(
            torch.cat([g.reshape(-1) for g in grads[r]]),
            shapes,
            [Slot(f"t{t}", 0, world, r) for t in range(len(shapes))],
        )
        for r, comp in enumerate(comps)
    ]
    results, _ = drive_ranks(protocols)
    for t, shape in enumerate(shapes):
        k = num_selected(shape.numel(), 0.02)
        assert not partition_pays(k, world)
        expected = torch.zeros(shape.numel())
        for g in grads:
            flat = g[t].reshape(-1)
            top = torch.topk(flat.abs(), k).indices
            expected.index_add_(0, top, flat[top])
        start = sum(s.numel() for s in shapes[:t])
        for result in results:
            got = result.mean[start : start + shape.numel()]
            assert torch.equal(got, expected.div(world))


def test_the_engine_takes_a_buckets_compressed_tensors_as_one_partitioned_run() -> None:
    from thinwire.comm.runs import group_runs

    shapes = [torch.Size([400, 400]), torch.Size([4, 6]), torch.Size([128, 96]), torch.Size([7])]
    kinds = [(s, (torch.float32, torch.device("cpu"))) for s in shapes]
    compressed = [True, True, True, False]
    groups = [g for g in group_runs(kinds, compressed, TopK(partitioned=True)) if g.compressed]
    assert [(g.members, g.how) for g in groups] == [([0, 1, 2], "segments")]
    # without the option the large tensor goes alone, the small ones side by side
    groups = [g for g in group_runs(kinds, compressed, TopK()) if g.compressed]
    assert sorted((g.members, g.how) for g in groups) == [([0], "alone"), ([1, 2], "segments")]
