"""The partitioned sparse all-reduce (issue 29): a global top-k whose bytes per rank do not
grow with the number of ranks.

Up to 64 ranks are simulated in one process (:func:`~thinwire.compress.simulated.drive_ranks`:
one exchange protocol per rank in lock-step, each round answered as a communicator would,
the bytes each rank sends counted); the last tests run it on real gloo ranks through the
all-gather and direct communicators, and check the simulation against them.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from thinwire.compress import Slot
from thinwire.compress.dgc import DGC
from thinwire.compress.feedback import DGCMemory, ResidualMemory
from thinwire.compress.partitioned import ENTRY_BYTES, partition_pays
from thinwire.compress.selection import RADIX_ROUNDS
from thinwire.compress.simulated import drive_ranks
from thinwire.compress.simulated import exchange_on_ranks as _exchange
from thinwire.compress.topk import TopK


def _gradients(world: int, shape: tuple[int, int], seed: int) -> list[Tensor]:
    """Per-rank gradients that share some large entries (as real ones do) and whose
    magnitudes differ everywhere (no ties)."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < 0.02)
    return [common * 3 + torch.randn(shape, generator=gen) for _ in range(world)]


def _reference_mean(grads: Sequence[Tensor], k: int) -> Tensor:
    """The single-process reference: sum every rank's own top-k, keep the sum's top-k,
    divide by the number of ranks (flat)."""
    summed = torch.zeros(grads[0].numel())
    for g in grads:
        flat = g.reshape(-1)
        top = torch.topk(flat.abs(), k).indices
        summed.index_add_(0, top, flat[top])
    chosen = torch.topk(summed.abs(), k).indices
    expected = torch.zeros_like(summed)
    expected[chosen] = summed[chosen] / len(grads)
    return expected


@pytest.mark.parametrize("world", [4, 8, 16])
def test_every_rank_receives_the_global_top_k_of_the_summed_sparse_gradients(world: int):
    grads = _gradients(world, (256, 1024), seed=world)
    density = 0.01
    k = int(grads[0].numel() * density)
    assert partition_pays(k, world)
    comps = [TopK(density=density, partitioned=True) for _ in range(world)]
    results, _ = _exchange(comps, grads)
    expected = _reference_mean(grads, k)
    for result in results:
        assert torch.equal(result.mean.reshape(-1), expected)  # every rank, the same bits
    assert int((results[0].mean != 0).sum()) == k


def test_what_a_rank_sent_plus_what_it_kept_is_what_it_meant_to_send():
    world, steps = 8, 6
    comps = [TopK(density=0.02, partitioned=True, rebalance_every=2) for _ in range(world)]
    assert partition_pays(int(64 * 512 * 0.02), world)
    memories = [ResidualMemory() for _ in range(world)]
    gen = torch.Generator().manual_seed(3)
    meant = [torch.zeros(64, 512, dtype=torch.float64) for _ in range(world)]
    applied = torch.zeros(64, 512, dtype=torch.float64)
    held_back = 0
    for step in range(steps):
        grads = [torch.randn(64, 512, generator=gen) for _ in range(world)]
        corrected = []
        for rank, g in enumerate(grads):
            meant[rank] += g
            corrected.append(memories[rank].compensate(g, Slot("w", step, world, rank)))
        results, _ = _exchange(comps, corrected, step)
        for rank, result in enumerate(results):
            k = int(corrected[rank].numel() * 0.02)
            held_back += k - int(result.sent_indices.unique().numel())
            memories[rank].update(corrected[rank], result, Slot("w", step, world, rank), True)
            assert torch.equal(corrected[rank], memories[rank].residuals["w"])
        applied += results[0].mean * world
    residuals = sum(memories[r].residuals["w"].double() for r in range(world))
    torch.testing.assert_close(applied + residuals, sum(meant), rtol=0, atol=1e-4)
    assert held_back > 0  # entries were pruned in the middle: they waited in the memories


def test_bytes_per_rank_stay_within_3x_of_k_entries_whatever_the_number_of_ranks():
    density, shape = 0.01, (256, 1024)
    k = int(shape[0] * shape[1] * density)
    per_rank = {}
    for world in (4, 16, 64):
        grads = _gradients(world, shape, seed=7)
        comps = [TopK(density=density, partitioned=True, rebalance_every=1) for _ in range(world)]
        _exchange(comps, grads, step=0)  # re-balance on the first selection
        _, sent = _exchange(comps, grads, step=1)
        per_rank[world] = max(sent)
        assert max(sent) <= 3 * k * ENTRY_BYTES, (world, max(sent), k)
    gathered_at_64 = 63 * k * ENTRY_BYTES
    assert per_rank[64] * 10 < gathered_at_64


def test_small_tensors_on_few_ranks_are_gathered_where_that_sends_less():
    assert not partition_pays(k=50, world=4)  # 1.2 KB gathered against 0.8 KB + a histogram
    assert partition_pays(k=100, world=4)  # 2.4 KB against 1.6 KB + the same histogram
    assert partition_pays(k=100_000, world=4)
    assert partition_pays(k=1000, world=64)
    assert not partition_pays(k=10**6, world=1)
    covered = [bit for shift, width in RADIX_ROUNDS for bit in range(shift, shift + width)]
    assert sorted(covered) == list(range(31))  # each bit of a float32 magnitude, once
    assert [shift for shift, _ in RADIX_ROUNDS] == sorted(
        (shift for shift, _ in RADIX_ROUNDS), reverse=True
    )  # most significant digit first
    # gathered, an exchange of a small tensor adds every rank's k entries (no pruning)
    comps = [TopK(density=0.1, partitioned=True) for _ in range(4)]
    results, _ = _exchange(comps, _gradients(4, (4, 25), seed=1))
    assert int((results[0].mean != 0).sum()) > 10


def test_dgc_takes_the_option_and_keeps_pruned_entries_in_its_memory():
    world = 8
    comps = [DGC(density=0.02, warmup_steps=0, partitioned=True) for _ in range(world)]
    assert partition_pays(int(64 * 256 * 0.02), world)
    assert comps[0].segmented is False  # partitions are per tensor
    memories = [DGCMemory(momentum=0.9, masking=False) for _ in range(world)]
    grads = _gradients(world, (64, 256), seed=5)
    corrected = [m.compensate(g, Slot("w", 0, world, r)) for r, (m, g) in
                 enumerate(zip(memories, grads, strict=True))]  # fmt: skip
    pre = [c.clone() for c in corrected]
    results, _ = _exchange(comps, corrected)
    for rank, (memory, result) in enumerate(zip(memories, results, strict=True)):
        memory.update(corrected[rank], result, Slot("w", 0, world, rank), True)
        kept = memory.accumulators["w"].reshape(-1)
        sent = result.sent_indices
        assert torch.all(result.mean.reshape(-1)[sent] != 0)  # only what was applied
        assert sent.numel() < int(64 * 256 * 0.02)  # some of its entries were pruned
        assert torch.all(kept[sent] == 0)
        pruned = pre[rank].reshape(-1).abs() > 0
        pruned[sent] = False
        assert torch.equal(kept[pruned], pre[rank].reshape(-1)[pruned])


def test_bad_options_are_refused_with_what_to_write():
    with pytest.raises(ValueError, match="partitioned must be true or false"):
        TopK(partitioned="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rebalance_every must be an integer >= 0"):
        DGC(partitioned=True, rebalance_every=-1)


# -- on gloo ranks ----------------------------------------------------------------------------

GLOO_SHAPE, GLOO_DENSITY = (256, 1024), 0.01


def _round_on_gloo(rank: int, world: int, kind: str) -> list[tuple]:
    """Two partitioned exchanges (radix selection, then the window) driven round by
    round over a real communicator."""
    from thinwire.comm.collectives import COMMUNICATORS, Traffic

    communicator = COMMUNICATORS[kind]()
    compressor = TopK(density=GLOO_DENSITY, partitioned=True)
    steps = []
    for step in (0, 1):
        grad = _gradients(world, GLOO_SHAPE, seed=11 + step)[rank]
        protocol = compressor.exchange(grad, Slot("w", step, world, rank))
        answer, traffic, rounds = None, Traffic(), 0
        try:
            while True:
                done = communicator.execute([protocol.send(answer)])
                answer, rounds = done.answers[0], rounds + 1
                traffic.add(done.traffic)
        except StopIteration as stop:
            result = stop.value
        steps.append((result.mean.numpy(), result.sent_indices.numpy(), traffic.sent, rounds))
    return steps


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["allgather", "direct"])
def test_gloo_ranks_receive_what_the_simulated_ranks_do(pool4, kind: str) -> None:
    world = 4
    comps = [TopK(density=GLOO_DENSITY, partitioned=True) for _ in range(world)]
    found = pool4.run(_round_on_gloo, kind)
    k = int(GLOO_SHAPE[0] * GLOO_SHAPE[1] * GLOO_DENSITY)
    # to the owners, the cut (radix selection; then the window), back: as simulated
    for step in (0, 1):
        grads = _gradients(world, GLOO_SHAPE, seed=11 + step)
        ops: list = []
        protocols = [
            _counted(c.exchange(g, Slot("w", step, world, r)), ops if r == 0 else [])
            for r, (c, g) in enumerate(zip(comps, grads, strict=True))
        ]
        expected, sent = drive_ranks(protocols)
        assert 3 <= len(ops) <= 2 + len(RADIX_ROUNDS) + 1
        for rank, steps in enumerate(found):
            mean, applied, wire, rounds = steps[step]
            assert torch.equal(torch.from_numpy(mean), expected[rank].mean)
            assert torch.equal(torch.from_numpy(applied), expected[rank].sent_indices)
            assert rounds == len(ops)
            # the simulated count (rows only) plus headers, status bytes and the lengths
            assert sent[rank] <= wire <= sent[rank] + 4096, (wire, sent[rank])
            assert wire < 3 * k * ENTRY_BYTES


def _bucket_on_gloo(rank: int, world: int) -> list:
    """A bucket whose tensors take three paths in the same rounds: partitioned (large),
    gathered (small: the partitioned exchange would send more), dense (a bias)."""
    from thinwire.comm.engine import GradientExchange, GradientItem

    gen = torch.Generator().manual_seed(rank)
    grads = {
        "big": torch.randn(GLOO_SHAPE, generator=gen),
        "small": torch.randn(8, 16, generator=gen),
        "bias": torch.randn(16, generator=gen),
    }
    engine = GradientExchange(TopK(density=GLOO_DENSITY, partitioned=True))
    means = engine.exchange([GradientItem(key, g) for key, g in grads.items()])
    return [m.numpy() for m in means]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_bucket_mixing_partitioned_gathered_and_dense_tensors_agrees_on_every_rank(pool4):
    found = pool4.run(_bucket_on_gloo)
    world = 4
    grads = []
    for rank in range(world):
        gen = torch.Generator().manual_seed(rank)
        grads.append([torch.randn(GLOO_SHAPE, generator=gen), torch.randn(8, 16, generator=gen),
                      torch.randn(16, generator=gen)])  # fmt: skip
    big, _ = _exchange([TopK(density=GLOO_DENSITY, partitioned=True) for _ in range(world)],
                       [g[0] for g in grads])  # fmt: skip
    small, _ = _exchange([TopK(density=GLOO_DENSITY, partitioned=True) for _ in range(world)],
                         [g[1] for g in grads])  # fmt: skip
    bias = sum(g[2] for g in grads) / world
    for means in found:
        assert torch.equal(torch.from_numpy(means[0]), big[0].mean)
        assert torch.equal(torch.from_numpy(means[1]), small[0].mean)
        torch.testing.assert_close(torch.from_numpy(means[2]), bias)
    assert all(all((a == b).all() for a, b in zip(found[0], m, strict=True)) for m in found)


def test_communicators_that_cannot_scatter_refuse_the_option_with_what_to_use() -> None:
    from thinwire.data_parallel.parameter_server.links import WorkerFanIn
    from thinwire.errors import IncompatibleCompressorError

    server = WorkerFanIn([], world_size=2, replies=False)
    with pytest.raises(IncompatibleCompressorError, match="use partitioned=False here"):
        server.check(TopK(partitioned=True))


def test_the_planner_replays_the_partitioned_exchange_and_counts_its_bytes() -> None:
    """The cost model replays the protocol on one rank as if every rank sent what it
    sends: about 2k entries in two all-to-alls plus the histograms, against (N - 1) k
    entries gathered."""
    from thinwire.plan.network import ALLGATHER, ALLREDUCE, ALLTOALL, PACED, wire_bytes
    from thinwire.plan.profile_exchangers import ThinwireEngine

    world, numel, density = 16, 2**18, 0.01
    k = int(numel * density)
    grad = torch.randn(numel // 256, 256, generator=torch.Generator().manual_seed(0))
    recorded = {}
    for partitioned in (False, True):
        engine = ThinwireEngine(TopK(density=density, partitioned=partitioned), world, True)
        protocol = engine.engine.compressor.exchange(grad, Slot("w", 0, world, 0))
        communicator = engine.communicator
        communicator.sent = []
        answer = None
        try:
            while True:
                answer = communicator.execute([protocol.send(answer)]).answers[0]
        except StopIteration:
            pass
        recorded[partitioned] = list(communicator.sent)
    (gathered,) = recorded[False]
    assert gathered.kind == ALLGATHER
    assert wire_bytes(ALLGATHER, gathered.nbytes, world) >= (world - 1) * k * ENTRY_BYTES
    kinds = [c.kind for c in recorded[True]]
    # per scatter round: the lengths' all-to-all, then the messages', paced
    assert kinds.count(ALLTOALL) == 2 and kinds.count(PACED) == 2
    assert 1 <= kinds.count(ALLREDUCE) <= len(RADIX_ROUNDS)
    total = sum(wire_bytes(c.kind, c.nbytes, world) for c in recorded[True])
    assert 1.5 * k * ENTRY_BYTES < total < 3 * k * ENTRY_BYTES


# -- block sparsity -------------------------------------------------------------------------


def test_blocks_with_the_largest_norms_travel_with_one_index_each() -> None:
    from thinwire.compress import run_locally

    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(10, 13, generator=gen) * 0.01  # 130 values: the last block is short
    grad.view(-1)[40:48] = 5.0  # block 5 of 8 values
    grad.view(-1)[128:130] = 9.0  # the short last block (16): its norm is the second largest
    comp = TopK(density=0.1, block=8)  # 13 values: two blocks
    payload, numel = comp.compress(grad, Slot("w", 0, 1))
    values, blocks = payload
    assert sorted(blocks.tolist()) == [5, 16] and values.numel() == 16
    assert sum(t.numel() * t.element_size() for t in payload) == 2 * (4 * 8 + 4)
    restored = comp.decompress(payload, numel)
    expected = torch.zeros(130)
    expected[40:48], expected[128:130] = 5.0, 9.0
    assert torch.equal(restored, expected)
    result = run_locally(comp.exchange(grad, Slot("w", 0, 1)))
    assert torch.equal(result.mean.reshape(-1), expected)
    assert sorted(result.sent_indices.tolist()) == [*range(40, 48), 128, 129]


def test_ranks_blocks_add_up_and_what_was_not_sent_stays_in_memory() -> None:
    world = 4
    grads = _gradients(world, (32, 64), seed=2)
    comps = [TopK(density=0.05, block=4) for _ in range(world)]
    memories = [ResidualMemory() for _ in range(world)]
    corrected = [m.compensate(g, Slot("w", 0, world, r)) for r, (m, g) in
                 enumerate(zip(memories, grads, strict=True))]  # fmt: skip
    before = [c.clone() for c in corrected]
    results, _ = _exchange(comps, corrected)
    total = torch.zeros(32 * 64)
    for rank, result in enumerate(results):
        memories[rank].update(corrected[rank], result, Slot("w", 0, world, rank), True)
        sent = before[rank].reshape(-1) - memories[rank].residuals["w"].reshape(-1)
        assert int((sent != 0).sum()) == int(32 * 64 * 0.05 / 4 + 0.5) * 4  # whole blocks
        total += sent
    for result in results:
        torch.testing.assert_close(result.mean.reshape(-1), total / world)


def test_block_options_are_checked() -> None:
    with pytest.raises(ValueError, match="block must be an integer >= 1"):
        TopK(block=0)
    with pytest.raises(ValueError, match="do not go together yet"):
        DGC(block=4, partitioned=True)
    assert DGC(block=4).segmented is False


# -- the threshold in few rounds --------------------------------------------------------------


def _counted(protocol, ops: list):
    """``protocol``, noting the kind of each round it asks for in ``ops``."""
    answer = None
    try:
        while True:
            request = protocol.send(answer)
            ops.append(request.op)
            answer = yield request
    except StopIteration as stop:
        return stop.value


def _bits(value: float) -> int:
    """A float32's bit pattern."""
    return int(torch.tensor([value], dtype=torch.float32).view(torch.int32))


def _value(bits: int) -> float:
    """The float32 of a bit pattern."""
    return float(torch.tensor([bits], dtype=torch.int32).view(torch.float32))


def _kth_on_ranks(per_rank: list[Tensor], k: int, hint: int) -> tuple[int, list]:
    """:func:`select_cut` driven on ``len(per_rank)`` simulated ranks, the cut (asserted
    the same on every rank) resolved from every rank's candidates as the partitioned
    exchange resolves it: the threshold and the kinds of rounds taken. Also checks that
    the boundary bin holds few candidates beyond those it keeps, unless every bit was
    decided."""
    from thinwire.compress.selection import SPARE_CANDIDATES, select_cut

    ops: list = []
    protocols = [
        _counted(select_cut(bits, k, hint), ops if rank == 0 else [])
        for rank, bits in enumerate(per_rank)
    ]
    found, _ = drive_ranks(protocols)
    assert len(set(found)) == 1
    cut = found[0]
    sent_on = torch.cat([bits[cut.candidates_or_above(bits)] for bits in per_rank])
    in_bin = int((torch.bitwise_right_shift(sent_on, cut.shift) == cut.prefix).sum())
    assert cut.shift == 0 or in_bin - (cut.need or in_bin) <= SPARE_CANDIDATES
    return cut.threshold(sent_on), ops


@pytest.mark.parametrize("world", [2, 5, 16])
def test_the_windowed_threshold_is_the_exact_kth_largest_wherever_the_hint_is(world: int):
    """Against sorting every rank's values: hints at the answer, near it, an octave and
    more away (the window misses: radix selection takes over), none; values spread over
    decades and values crowded into one bin (its values too many to gather)."""
    from thinwire.compress.base import Op
    from thinwire.compress.selection import LOW_ROUNDS, RADIX_ROUNDS, SPARE_CANDIDATES

    gen = torch.Generator().manual_seed(world)
    spread = [torch.randn(300, generator=gen).abs() * 10 ** torch.randint(-4, 2, (300,),
              generator=gen) for _ in range(world)]  # fmt: skip
    crowded = [1.0 + torch.rand(1100, generator=gen) * 1e-3 for _ in range(world)]
    for values in (spread, crowded):
        bits = [v.float().view(torch.int32) for v in values]
        every = torch.cat(bits).sort(descending=True).values
        for k in (1, 7, 100, every.numel() - 1, every.numel(), every.numel() + 5):
            want = int(every[k - 1]) if k < every.numel() else 0
            if k == every.numel():
                want = 0  # at most k in all: keep every one
            for factor in (None, 1.0, 1.1, 0.7, 3.0, 0.2, 1e4):
                hint = 0 if factor is None or want == 0 else _bits(_value(want) * factor)
                found, ops = _kth_on_ranks(bits, k, hint)
                assert found == want, (k, factor)
                assert set(ops) == {Op.SUM}
                if hint == 0:  # radix rounds until the boundary bin is small
                    assert 1 <= len(ops) <= len(RADIX_ROUNDS)
                elif factor in (1.0, 1.1, 0.7) and values is spread:
                    assert len(ops) == 1  # the window alone: its boundary bin is small
                elif factor == 1.0 and k < every.numel() - SPARE_CANDIDATES:
                    # crowded, many left out of the bin: radix over its low bits
                    assert 2 <= len(ops) <= 1 + len(LOW_ROUNDS)
                elif factor in (0.2, 1e4):  # out of the window: one round lost
                    assert 2 <= len(ops) <= 1 + len(RADIX_ROUNDS)


def test_after_the_first_step_the_exchange_takes_three_rounds_and_stays_exact():
    """Four steps of slowly changing gradients, then one ten thousand times larger: the
    global top-k equals the single-process reference at every step; rounds (a scatter is
    one here, two all-to-alls on a communicator): 1 + at most 6 + 1 on the first step
    (radix selection until the boundary bin is small), 1 + 1 + 1 after (the window), at
    least one more where the threshold left the window."""
    from thinwire.compress.selection import RADIX_ROUNDS

    world, density, shape = 8, 0.01, (128, 512)
    k = int(shape[0] * shape[1] * density)
    comps = [TopK(density=density, partitioned=True) for _ in range(world)]
    base = _gradients(world, shape, seed=21)
    gen = torch.Generator().manual_seed(22)
    rounds = []
    for step, scale in enumerate((1.0, 1.0, 1.0, 1.0, 1e4)):
        grads = [(g + 0.05 * torch.randn(shape, generator=gen)) * scale for g in base]
        ops: list = []
        protocols = [
            _counted(c.exchange(g, Slot("w", step, world, r)), ops if r == 0 else [])
            for r, (c, g) in enumerate(zip(comps, grads, strict=True))
        ]
        results, _ = drive_ranks(protocols)
        expected = _reference_mean(grads, k)
        for result in results:
            assert torch.equal(result.mean.reshape(-1), expected), step
        rounds.append(len(ops))
    assert 1 + 1 + 1 <= rounds[0] <= 1 + len(RADIX_ROUNDS) + 1
    assert rounds[1:4] == [3, 3, 3]
    assert 1 + 2 + 1 <= rounds[4] <= 1 + 1 + len(RADIX_ROUNDS) + 1
