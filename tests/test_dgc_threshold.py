"""DGC's threshold selection (``selection="threshold"``, the default off the CPU): about k
entries above a sampled estimate of the k-th magnitude, with no value read back on the
host. Run here on the CPU; ``tests/test_gpu_sync.py`` checks on a GPU that it never
makes the host wait."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import thinwire
from thinwire.comm import GradientItem
from thinwire.comm.runs import plan_runs, split_flat
from thinwire.compress import Slot, run_locally
from thinwire.compress.dgc import DGC
from thinwire.compress.dgc_segments import ThresholdSegments, aim_below
from thinwire.compress.feedback import DGCMemory


def magnitudes_all_different(n: int, seed: int) -> Tensor:
    """``n`` values whose magnitudes are all different, in random order and sign."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.randperm(n, generator=gen).float() + 1
    signs = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    return magnitudes * signs / n


def check_payload(flat: Tensor, indices: Tensor, values: Tensor, k: int) -> set[int]:
    """Exactly k pairs; each nonzero value is the tensor's at its index; indices of
    nonzero values are distinct, and a zero value (padding) repeats a sent index or
    points at a zero. Returns the indices sent with their value."""
    assert indices.shape == (k,) and values.shape == (k,)
    assert indices.dtype == torch.int64
    assert int(indices.min()) >= 0 and int(indices.max()) < flat.numel()
    sent = values != 0
    torch.testing.assert_close(values[sent], flat[indices[sent]], rtol=0, atol=0)
    real = indices[sent].tolist()
    assert len(real) == len(set(real)), "an entry was sent twice"
    for index in indices[~sent].tolist():
        assert index in set(real) or float(flat[index]) == 0.0
    return set(real)


def test_a_full_sample_finds_exactly_the_largest() -> None:
    flat = magnitudes_all_different(20_000, seed=1)
    dgc = DGC(warmup_steps=0, density=0.01, sample_fraction=1.0, selection="threshold")
    assert dgc.stride == 2  # the smallest prime >= 1: every second value sampled
    dgc.stride = 1  # sample everything: the threshold is a true order statistic
    k = 400
    indices, values = dgc.pick(flat, k, Slot("w", 0, 1))
    aimed = aim_below(k)  # two standard deviations below k: 400 - 40
    assert aimed == 360
    exact = set(torch.topk(flat.abs(), aimed).indices.tolist())
    assert check_payload(flat, indices, values, k) == exact


@pytest.mark.parametrize("seed", range(5))
def test_a_sampled_threshold_sends_about_k_of_the_largest(seed: int) -> None:
    flat = torch.randn(200_000, generator=torch.Generator().manual_seed(seed))
    k = 2000
    dgc = DGC(warmup_steps=0, density=0.01, seed=seed, selection="threshold")
    indices, values = dgc.pick(flat, k, Slot("w", 0, 1))
    sent = check_payload(flat, indices, values, k)
    assert 0.75 * k <= len(sent) <= k
    exact = set(torch.topk(flat.abs(), k).indices.tolist())
    assert len(sent & exact) >= 0.75 * k  # most of the top-k
    # and nothing far below it: every entry sent is in the top 1.2 k
    wider = set(torch.topk(flat.abs(), int(1.2 * k)).indices.tolist())
    assert sent <= wider


def test_fewer_nonzeros_than_k_are_all_sent_and_the_rest_padded() -> None:
    flat = torch.zeros(100_000)
    where = torch.randperm(100_000, generator=torch.Generator().manual_seed(3))[:40]
    flat[where] = torch.linspace(1, 2, 40)
    dgc = DGC(warmup_steps=0, density=0.01, selection="threshold")
    indices, values = dgc.pick(flat, 1000, Slot("w", 0, 1))
    assert check_payload(flat, indices, values, 1000) == set(where.tolist())
    assert int((values != 0).sum()) == 40


def test_an_all_zero_tensor_sends_zeros() -> None:
    flat = torch.zeros(70_000)
    dgc = DGC(warmup_steps=0, density=0.01, selection="threshold")
    indices, values = dgc.pick(flat, 700, Slot("w", 0, 1))
    assert indices.shape == (700,) and not values.any()


def test_what_a_cut_leaves_goes_in_a_later_step() -> None:
    # every value equal: all pass the threshold and only the first k go; what stays
    # behind grows in the memory until it passes first: none waits for ever
    dgc = DGC(warmup_steps=0, density=0.01, selection="threshold")
    memory = DGCMemory(momentum=0.0)
    sent_at = torch.full((100_000,), -1)
    for step in range(200):
        slot = Slot("w", step, 1)
        corrected = memory.compensate(torch.ones(100_000), slot)
        result = run_locally(dgc.exchange(corrected, slot))
        memory.update(corrected, result, slot, compressed=True)
        newly = (result.mean != 0) & (sent_at < 0)
        sent_at[newly] = step
    assert int((sent_at < 0).sum()) == 0, "some entries were never sent"


def test_auto_takes_the_threshold_off_the_cpu_only() -> None:
    dgc = DGC()
    assert not dgc.by_threshold(torch.device("cpu"))
    assert dgc.by_threshold(torch.device("cuda", 0))
    assert DGC(selection="threshold").by_threshold(torch.device("cpu"))
    assert not DGC(selection="exact").by_threshold(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="selection must be one of 'auto', 'exact'"):
        DGC(selection="fast")


def test_the_selection_leaves_a_checkpoints_owner_unchanged() -> None:
    # a DGC state saved before the option existed, or on a GPU, resumes on the CPU
    assert repr(DGC()) == repr(DGC(selection="threshold")) == repr(DGC(selection="exact"))
    assert "selection" not in repr(DGC())


def test_two_ranks_average_what_each_sent_and_keep_the_rest() -> None:
    """Through the exchange and DGC's memory: what every step averaged plus what each
    rank still holds equals what the ranks put in (momentum 0), over many steps."""
    gen = torch.Generator().manual_seed(5)
    dgcs = [DGC(warmup_steps=0, density=0.01, selection="threshold", seed=r) for r in range(2)]
    memories = [DGCMemory(momentum=0.0) for _ in range(2)]
    total_in = torch.zeros(300, 400, dtype=torch.float64)
    total_out = torch.zeros(300, 400, dtype=torch.float64)
    for step in range(8):
        grads = [torch.randn(300, 400, generator=gen) for _ in range(2)]
        total_in += sum(g.double() for g in grads) / 2
        slots = [Slot("w", step, 2, r) for r in range(2)]
        correcteds = [m.compensate(g, s) for m, g, s in zip(memories, grads, slots, strict=True)]
        protocols = [d.exchange(c, s) for d, c, s in zip(dgcs, correcteds, slots, strict=True)]
        requests = [p.send(None) for p in protocols]
        gathered = [[t.clone() for t in r.tensors] for r in requests]
        results = []
        for protocol in protocols:
            try:
                protocol.send(gathered)
            except StopIteration as stop:
                results.append(stop.value)
        torch.testing.assert_close(results[0].mean, results[1].mean, rtol=0, atol=0)
        for memory, corrected, result, slot in zip(
            memories, correcteds, results, slots, strict=True
        ):
            memory.update(corrected, result, slot, compressed=True)
        total_out += results[0].mean.double()
    held = sum(m.accumulators["w"].double() for m in memories) / 2
    torch.testing.assert_close(total_out + held, total_in, rtol=0, atol=1e-4)
    assert float(total_out.abs().sum()) > 1.0


def test_a_run_alone_matches_run_locally() -> None:
    flat = torch.randn(100, 1000, generator=torch.Generator().manual_seed(6))
    dgc = DGC(warmup_steps=0, density=0.01, selection="threshold", seed=2)
    result = run_locally(dgc.exchange(flat, Slot("w", 0, 1)))
    assert int((result.mean != 0).sum()) <= 1000
    sent = result.mean != 0
    torch.testing.assert_close(result.mean[sent], flat[sent], rtol=0, atol=0)


def test_a_large_tensor_alone_in_its_run_takes_the_single_tensor_selection() -> None:
    """A bucket with one large tensor: its run of one segment sends what the tensor's own
    exchange sends (the selection ``bench/dgc_selection.py`` times)."""
    flat = torch.randn(200_000, generator=torch.Generator().manual_seed(11))
    slot = Slot("w", 0, 1)
    one, other = (DGC(warmup_steps=0, density=0.01, selection="threshold") for _ in range(2))
    alone = run_locally(one.exchange(flat, slot))
    run = run_locally(other.exchange_segmented(flat, [flat.shape], [slot]))
    assert run.sent_counts == [2000]
    assert torch.equal(run.sent_indices, alone.sent_indices)
    assert torch.equal(run.mean, alone.mean)


def test_segments_send_each_tensors_own_largest() -> None:
    shapes = [torch.Size([300, 400]), torch.Size([70_000]), torch.Size([500, 300, 2])]
    sizes = [120_000, 70_000, 300_000]
    gen = torch.Generator().manual_seed(7)
    # segments of very different scales: each must get its own threshold
    parts = [torch.randn(s, generator=gen) * scale for s, scale in zip(sizes, [1, 100, 1e-3])]
    flat = torch.cat(parts)
    dgc = DGC(warmup_steps=0, density=0.01, selection="threshold")
    layout = ThresholdSegments(shapes, 0.01, dgc._threshold_stride)
    assert layout.ks == [1200, 700, 3000]
    for offset in (0, layout.offsets - 1):
        indices, values = layout.pick(flat, offset)
        start = 0
        for part, k, chunk_i, chunk_v in zip(
            parts, layout.ks, indices.split(layout.ks), values.split(layout.ks), strict=True
        ):
            local = chunk_i - start
            assert int(local.min()) >= 0 and int(local.max()) < part.numel()
            sent = check_payload(part, local, chunk_v, k)
            exact = set(torch.topk(part.abs(), k).indices.tolist())
            assert 0.75 * k <= len(sent) <= k
            assert len(sent & exact) >= 0.75 * k
            assert sent <= set(torch.topk(part.abs(), int(1.2 * k)).indices.tolist())
            start += part.numel()


def test_segments_of_zeros_and_of_few_values_are_padded() -> None:
    shapes = [torch.Size([100_000]), torch.Size([100_000]), torch.Size([100_000])]
    flat = torch.zeros(300_000)
    flat[100_000:100_030] = torch.linspace(1, 2, 30)  # the second: 30 nonzeros, k = 1000
    flat[200_000:] = torch.randn(100_000, generator=torch.Generator().manual_seed(8))
    layout = ThresholdSegments(shapes, 0.01, DGC(selection="threshold")._threshold_stride)
    indices, values = layout.pick(flat, 0)
    first, second, _ = indices.split(layout.ks)
    v1, v2, v3 = values.split(layout.ks)
    assert not v1.any() and int(first.min()) >= 0 and int(first.max()) < 100_000
    assert set(second[v2 != 0].tolist()) == set(range(100_000, 100_030))
    assert int(second.min()) >= 100_000 and int(second.max()) < 100_030
    assert int((v3 != 0).sum()) >= 750


def test_large_tensors_run_side_by_side_where_the_threshold_selects() -> None:
    correcteds = [torch.randn(300, 300), torch.randn(10), torch.randn(400, 200), torch.randn(8, 8)]
    threshold = DGC(selection="threshold")
    compressed = [threshold.compresses(c) for c in correcteds]
    runs = [(p.members, p.shapes is not None) for p in plan_runs(correcteds, compressed, threshold)]
    assert runs == [([1], False), ([3], True), ([0, 2], True)]
    exact = DGC(selection="exact")
    runs = [(p.members, p.shapes is not None) for p in plan_runs(correcteds, compressed, exact)]
    assert runs == [([1], False), ([3], True), ([0], False), ([2], False)]


def test_a_bucket_of_large_tensors_conserves_what_it_does_not_send() -> None:
    """Two ranks, several steps, large tensors side by side through DGC's exchange and
    memory: what was averaged plus what the ranks hold equals what they put in."""
    shapes = [torch.Size([300, 300]), torch.Size([400, 200])]
    gen = torch.Generator().manual_seed(9)
    dgcs = [DGC(warmup_steps=0, density=0.01, selection="threshold", seed=r) for r in range(2)]
    memories = [DGCMemory(momentum=0.0) for _ in range(2)]
    total_in = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    total_out = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for step in range(6):
        slots = [[Slot(key, step, 2, r) for key in "ab"] for r in range(2)]
        correcteds, protocols = [], []
        for r in range(2):
            grads = [torch.randn(s, generator=gen) for s in shapes]
            for total, grad in zip(total_in, grads, strict=True):
                total += grad.double() / 2
            corrected = memories[r].compensate_many(grads, slots[r], [None, None])
            correcteds.append(corrected)
            flat = torch.cat([c.reshape(-1) for c in corrected])
            protocols.append(dgcs[r].exchange_segmented(flat, shapes, slots[r]))
        requests = [p.send(None) for p in protocols]
        gathered = [[t.clone() for t in r.tensors] for r in requests]
        outcomes = []
        for protocol in protocols:
            try:
                protocol.send(gathered)
            except StopIteration as stop:
                outcomes.append(stop.value)
        torch.testing.assert_close(outcomes[0].mean, outcomes[1].mean, rtol=0, atol=0)
        split = split_flat([torch.empty(s) for s in shapes])
        for r in range(2):
            results = split(outcomes[r])
            memories[r].update_many(correcteds[r], results, slots[r], [True, True])
        for total, result in zip(total_out, split(outcomes[0]), strict=True):
            total += result.mean.double()
    for key, total_i, total_o in zip("ab", total_in, total_out, strict=True):
        held = sum(m.accumulators[key].double() for m in memories) / 2
        torch.testing.assert_close(total_o + held, total_i, rtol=0, atol=1e-4)
        assert float(total_o.abs().sum()) > 1.0


# -- a fixed number of operators per bucket, whatever its tensors ------------------------


class CountOps(TorchDispatchMode):
    """Counts the non-view ATen operators run on this thread while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def operators_per_step(rank: int, world: int, method: str, options: dict, layers: int) -> int:
    """One steady-state step's operators of ``layers`` large weights (300 x 300)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(300, 300) for _ in range(layers)])
    opt = thinwire.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model, method, **options
    )
    opt.engine.defer_verdicts = True  # as on a GPU
    for step in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step + rank))
        buckets = [[GradientItem(n, p.grad, p) for n, p in bucket] for bucket in opt.buckets]
        counter = CountOps()
        with counter:
            opt._exchange(buckets)
    return counter.ops


@pytest.mark.multiprocess
def test_a_bucket_takes_as_many_operators_whatever_its_number_of_large_tensors(pool2) -> None:
    """The host's work a GPU waits for: constant for ``none`` however many tensors a
    bucket holds, and for DGC's threshold selection too: the selection and the exchange
    take the weights as segments, the biases (sent dense) leave the memory in one
    multi-tensor operation, and the memory, holding a run's buffers side by side, zeroes
    every weight's sent entries in one (it took one operator a weight before)."""
    none = {}
    dgc = {"density": 0.01, "selection": "threshold", "warmup_steps": 0}
    assert pool2.run(operators_per_step, "none", none, 3) == pool2.run(
        operators_per_step, "none", none, 9
    )
    few = pool2.run(operators_per_step, "dgc", dgc, 3)
    many = pool2.run(operators_per_step, "dgc", dgc, 9)
    assert few == many, (few, many)


def train_laid_out_or_not(rank: int, world: int, method: str, options: dict) -> list[bool]:
    """Eight steps of a model with large and small weights, the memory laid out by run
    (as the engine does) and not; whether each parameter ends the same to the bit."""
    import thinwire.comm.engine as engine_module

    finals = []
    for laid_out in (True, False):
        saved = engine_module.arrange_memory
        if not laid_out:
            engine_module.arrange_memory = lambda *args: []  # no run laid out
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(300, 300), torch.nn.Linear(300, 20), torch.nn.Linear(20, 300)
            )
            opt = thinwire.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), model, method, **options
            )
            opt.engine.defer_verdicts = True  # as on a GPU
            gen = torch.Generator().manual_seed(rank)
            for _ in range(8):
                model(torch.randn(16, 300, generator=gen)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            engine_module.arrange_memory = saved
        finals.append([p.detach().clone() for p in model.parameters()])
    return [torch.equal(a, b) for a, b in zip(*finals, strict=True)]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("dgc", {"density": 0.01, "selection": "threshold", "warmup_steps": 0}),
        ("dgc", {"density": 0.01, "masking": True, "warmup_steps": 0}),
        ("topk", {"density": 0.05}),
        ("onebit", {}),
        ("powersgd", {"rank": 2}),
    ],
)
def test_a_memory_laid_out_by_run_trains_to_the_same_bits(
    pool2, method: str, options: dict
) -> None:
    for same in pool2.run(train_laid_out_or_not, method, options, timeout=120):
        assert all(same), same
