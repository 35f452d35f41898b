"""The partitioned exchange keeping more of the sum than the ranks pick (issue 29, ``keep``):
each rank sends its k entries, every rank applies the global top ``keep * k`` of their sum
(all of it where the picks cover fewer places), and what was pruned waits in the memories.
Ranks simulated in one process (:func:`~thinwire.compress.simulated.drive_ranks`)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from thinwire.compress import Slot
from thinwire.compress.base import num_selected
from thinwire.compress.dgc import DGC
from thinwire.compress.feedback import ResidualMemory
from thinwire.compress.partitioned import ENTRY_BYTES, partition_pays
from thinwire.compress.simulated import drive_ranks
from thinwire.compress.simulated import exchange_on_ranks as _exchange
from thinwire.compress.topk import TopK

SHAPE = (128, 512)


def _gradients(world: int, seed: int, shape: tuple[int, int] = SHAPE) -> list[Tensor]:
    """Per-rank gradients sharing a few large entries, otherwise their own (no ties)."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < 0.01)
    return [common * 3 + torch.randn(shape, generator=gen) for _ in range(world)]


def _sum_of_picks(grads: Sequence[Tensor], k: int) -> Tensor:
    """Every rank's own top-k added where they fall (flat)."""
    summed = torch.zeros(grads[0].numel())
    for g in grads:
        flat = g.reshape(-1)
        top = torch.topk(flat.abs(), k).indices
        summed.index_add_(0, top, flat[top])
    return summed


@pytest.mark.parametrize("keep", [2, 4])
def test_every_rank_receives_the_global_top_keep_k_of_the_summed_picks(keep: int) -> None:
    world, density = 16, 0.01
    grads = _gradients(world, seed=keep)
    k = num_selected(grads[0].numel(), density)
    assert partition_pays(k, world, keep)
    summed = _sum_of_picks(grads, k)
    assert int((summed != 0).sum()) > keep * k  # the picks cover more places than kept
    chosen = torch.topk(summed.abs(), keep * k).indices
    expected = torch.zeros_like(summed)
    expected[chosen] = summed[chosen] / world
    comps = [TopK(density=density, partitioned=True, keep=keep) for _ in range(world)]
    results, sent = _exchange(comps, grads)
    for result in results:
        assert torch.equal(result.mean.reshape(-1), expected)
    assert int((results[0].mean != 0).sum()) == keep * k
    # each rank's applied entries are its picks that made the cut, and nothing else
    for rank, result in enumerate(results):
        own = torch.topk(grads[rank].reshape(-1).abs(), k).indices
        made_it = own[torch.isin(own, chosen)]
        assert torch.equal(torch.sort(result.sent_indices).values, torch.sort(made_it).values)
    # more applied than keep=1, at about k out and keep * k back a rank
    single, _ = _exchange([TopK(density=density, partitioned=True) for _ in range(world)], grads)
    applied = sum(r.sent_indices.numel() for r in results)
    assert applied > sum(r.sent_indices.numel() for r in single)
    assert max(sent) <= (keep + 2) * k * ENTRY_BYTES, (max(sent), k)


def test_where_the_picks_cover_fewer_places_than_kept_every_pick_is_applied() -> None:
    world, density, keep = 16, 0.01, 4
    gen = torch.Generator().manual_seed(3)
    shared = torch.randn(SHAPE, generator=gen) * 100  # the ranks' picks mostly coincide
    grads = [shared + torch.randn(SHAPE, generator=gen) for _ in range(world)]
    k = num_selected(grads[0].numel(), density)
    assert partition_pays(k, world, keep)
    expected = _sum_of_picks(grads, k) / world
    assert k < int((expected != 0).sum()) < keep * k
    comps = [TopK(density=density, partitioned=True, keep=keep) for _ in range(world)]
    results, _ = _exchange(comps, grads)
    for rank, result in enumerate(results):
        assert torch.equal(result.mean.reshape(-1), expected)
        own = torch.topk(grads[rank].reshape(-1).abs(), k).indices
        assert torch.equal(torch.sort(result.sent_indices).values, torch.sort(own).values)


def test_partitioning_pays_with_keep_only_where_k_plus_keep_k_is_below_gathering() -> None:
    assert partition_pays(k=1000, world=16, keep=4)  # 5 k against 15 k
    assert not partition_pays(k=1000, world=4, keep=4)  # 5 k against 3 k: gathered
    assert partition_pays(k=1000, world=8, keep=4)  # 5 k against 7 k
    assert not partition_pays(k=1000, world=6, keep=4)  # 5 k + histograms against 5 k
    assert partition_pays(k=1000, world=4) and not partition_pays(k=1000, world=4, keep=2)


def test_what_each_rank_sent_plus_what_it_kept_is_what_it_meant_to_send_with_keep() -> None:
    world, steps, density, keep = 16, 5, 0.02, 4
    shape = (32, 256)
    comps = [
        TopK(density=density, partitioned=True, keep=keep, rebalance_every=2) for _ in range(world)
    ]
    memories = [ResidualMemory() for _ in range(world)]
    gen = torch.Generator().manual_seed(5)
    meant = [torch.zeros(shape, dtype=torch.float64) for _ in range(world)]
    applied = torch.zeros(shape, dtype=torch.float64)
    held_back = 0
    for step in range(steps):
        corrected = []
        for rank in range(world):
            g = torch.randn(shape, generator=gen)
            meant[rank] += g
            corrected.append(memories[rank].compensate(g, Slot("w", step, world, rank)))
        results, _ = _exchange(comps, corrected, step)
        k = num_selected(corrected[0].numel(), density)
        for rank, result in enumerate(results):
            held_back += k - int(result.sent_indices.unique().numel())
            memories[rank].update(corrected[rank], result, Slot("w", step, world, rank), True)
        applied += results[0].mean * world
    residuals = sum(memories[r].residuals["w"].double() for r in range(world))
    torch.testing.assert_close(applied + residuals, sum(meant), rtol=0, atol=1e-4)
    assert held_back > 0


def test_a_bucket_run_with_keep_exchanges_what_each_tensor_would_alone() -> None:
    world, density, keep = 16, 0.02, 4
    shapes = [torch.Size([64, 512]), torch.Size([8, 10]), torch.Size([96, 128])]
    ks = [num_selected(s.numel(), density) for s in shapes]
    assert [partition_pays(k, world, keep) for k in ks] == [True, False, True]

    def make() -> DGC:
        return DGC(density=density, partitioned=True, keep=keep, warmup_steps=0,
                   rebalance_every=2, selection="exact")  # fmt: skip

    alone, together = [make() for _ in range(world)], [make() for _ in range(world)]
    for step in range(3):  # radix rounds, then the window; a re-balancing between
        gen = torch.Generator().manual_seed(step)
        grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(world)]
        expected = []
        for t in range(len(shapes)):
            protocols = [
                comp.exchange(grads[r][t], Slot(f"t{t}", step, world, r))
                for r, comp in enumerate(alone)
            ]
            expected.append(drive_ranks(protocols)[0])
        protocols = []
        for r, comp in enumerate(together):
            flat = torch.cat([g.reshape(-1) for g in grads[r]])
            slots = [Slot(f"t{t}", step, world, r) for t in range(len(shapes))]
            protocols.append(comp.exchange_segmented(flat, shapes, slots))
        results, _ = drive_ranks(protocols)
        for rank, result in enumerate(results):
            means = result.mean.split([s.numel() for s in shapes])
            sent = result.sent_indices.split(result.sent_counts)
            start = 0
            for t, shape in enumerate(shapes):
                own = expected[t][rank]
                assert torch.equal(means[t].view(shape), own.mean), (step, rank, t)
                mine = torch.sort(sent[t] - start).values
                assert torch.equal(mine, torch.sort(own.sent_indices).values), (step, rank, t)
                start += shape.numel()


def test_keep_is_checked_and_needs_the_partitioned_exchange() -> None:
    with pytest.raises(ValueError, match="keep must be an integer >= 1"):
        TopK(partitioned=True, keep=0)
    with pytest.raises(ValueError, match="keep must be an integer >= 1"):
        DGC(partitioned=True, keep=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only applies with partitioned=True"):
        DGC(keep=4)
    assert "keep=4" in repr(DGC(partitioned=True, keep=4))  # what the ranks agree on
