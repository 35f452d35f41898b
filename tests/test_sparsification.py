"""Sparsifiers (top-k, DGC, random-k) and error feedback, in one process; compressor options."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import thinwire
from compressor_cases import drive
from thinwire.compress import Slot, run_locally
from thinwire.compress.base import Compressor, Memory
from thinwire.compress.dgc import DGC, nonzero_positions, warmup_stages
from thinwire.compress.feedback import DGCMemory, NoMemory, ResidualMemory
from thinwire.compress.powersgd import PowerSGD
from thinwire.compress.powersgd_oneround import OneRoundPowerSGD
from thinwire.compress.randomk import RandomK, sample_without_replacement
from thinwire.compress.topk import TopK


def distinct_values(rows: int, cols: int, seed: int) -> Tensor:
    """A (rows, cols) tensor whose magnitudes are all different (no ties in top-k)."""
    gen = torch.Generator().manual_seed(seed)
    n = rows * cols
    magnitudes = torch.randperm(n, generator=gen).float() + 1
    signs = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    return (magnitudes * signs / n).view(rows, cols)


def exact_topk_set(x: Tensor, k: int) -> set[int]:
    """The flat indices of the k largest |x|, by torch.topk."""
    return set(torch.topk(x.abs().reshape(-1), k).indices.tolist())


# -- top-k and DGC selection --------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(2, 40),
    cols=st.integers(2, 300),
    density=st.floats(0.001, 0.5),
    seed=st.integers(0, 10_000),
)
def test_topk_selects_exactly_the_top_k_set(rows: int, cols: int, density: float, seed: int):
    x = distinct_values(rows, cols, seed)
    k = max(1, round(x.numel() * density))
    indices = TopK(density=density).select(x.reshape(-1), k, Slot("w", 0, 1))
    assert indices.numel() == k
    assert set(indices.tolist()) == exact_topk_set(x, k)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(2, 60),
    cols=st.integers(50, 1500),
    density=st.sampled_from([0.001, 0.003, 0.01, 0.05, 0.2]),
    sample_fraction=st.sampled_from([0.01, 0.05, 0.1, 0.3]),
    seed=st.integers(0, 10_000),
)
def test_dgc_sampled_selection_returns_the_exact_top_k_set(
    rows: int, cols: int, density: float, sample_fraction: float, seed: int
) -> None:
    x = distinct_values(rows, cols, seed)
    k = max(1, round(x.numel() * density))
    dgc = DGC(warmup_steps=0, density=density, sample_fraction=sample_fraction, seed=seed)
    indices = dgc.select(x.reshape(-1), k, Slot("w", 0, 1))
    assert indices.numel() == k
    assert set(indices.tolist()) == exact_topk_set(x, k)
    assert k <= dgc.last_candidates <= x.numel()


def test_dgc_uses_the_sampled_threshold_not_a_full_sort() -> None:
    # 100k entries, k = 100, a 1/11 sample: the threshold path, with the word-wise mask scan
    x = distinct_values(200, 500, seed=3)
    dgc = DGC(warmup_steps=0, density=0.001, sample_fraction=0.1)
    for step in range(5):
        indices = dgc.select(x.reshape(-1), 100, Slot("w", step, 1))
        assert set(indices.tolist()) == exact_topk_set(x, 100)
        assert dgc.last_tries >= 1
        assert 100 <= dgc.last_candidates < 500  # a few hundred candidates, not 100k


def test_dgc_retries_with_a_lower_threshold_and_falls_back_to_exact() -> None:
    x = distinct_values(100, 400, seed=4)
    too_high = DGC(warmup_steps=0, density=0.01, sample_fraction=0.1)
    too_high.margin_sigmas = -4.0  # aim far above the k-th value: the first try falls short
    indices = too_high.select(x.reshape(-1), 400, Slot("w", 0, 1))
    assert too_high.last_tries >= 2
    assert too_high.last_candidates < x.numel()  # a lower threshold worked: no fallback
    assert set(indices.tolist()) == exact_topk_set(x, 400)
    never = DGC(warmup_steps=0, density=0.01, sample_fraction=0.1)
    never.tries = 0
    indices = never.select(x.reshape(-1), 400, Slot("w", 0, 1))
    assert never.last_candidates == x.numel()  # exact fallback
    assert set(indices.tolist()) == exact_topk_set(x, 400)


def test_dgc_handles_mostly_zero_gradients() -> None:
    # the sample sees only zeros, so no threshold separates anything: exact top-k
    x = torch.zeros(100_000)
    x[torch.randperm(100_000, generator=torch.Generator().manual_seed(0))[:300]] = (
        torch.arange(300).float() + 1
    )
    dgc = DGC(warmup_steps=0, density=0.001)
    indices = dgc.select(x, 100, Slot("w", 0, 1))
    assert set(indices.tolist()) == exact_topk_set(x, 100)


def test_dgc_buffers_are_reused_across_tensors_of_different_sizes() -> None:
    dgc = DGC(warmup_steps=0, density=0.01, sample_fraction=0.1)
    big, small, odd = (
        distinct_values(100, 500, 1),
        distinct_values(30, 40, 2),
        distinct_values(7, 13, 5),
    )
    for x in (big, small, odd, big, odd):
        k = max(1, round(x.numel() * 0.01))
        assert set(dgc.select(x.reshape(-1), k, Slot("w", 0, 1)).tolist()) == exact_topk_set(x, k)
    assert dgc._magnitude.capacity == big.numel()  # grown once, for the largest


def test_dgc_mask_padding_from_a_longer_tensor_is_cleared() -> None:
    dgc = DGC(warmup_steps=0, density=0.05, sample_fraction=0.5)
    first = distinct_values(100, 100, seed=1)
    first.view(-1)[88:96] = 1000 + torch.arange(8.0)  # sets mask bytes 88..95
    dgc.select(first.reshape(-1), 500, Slot("w", 0, 1))
    odd = distinct_values(7, 13, seed=2)  # 91 entries: bytes 91..95 are padding now
    indices = dgc.select(odd.reshape(-1), 5, Slot("v", 0, 1))
    assert dgc.last_tries >= 1
    assert set(indices.tolist()) == exact_topk_set(odd, 5)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400), fill=st.floats(0, 1), seed=st.integers(0, 1000))
def test_wordwise_nonzero_matches_nonzero(n: int, fill: float, seed: int) -> None:
    padded = -(-n // 8) * 8
    mask = torch.zeros(padded, dtype=torch.bool)
    mask[:n] = torch.rand(n, generator=torch.Generator().manual_seed(seed)) < fill
    expected = mask.nonzero().view(-1)
    assert torch.equal(nonzero_positions(mask, sparse=True), expected)
    assert torch.equal(nonzero_positions(mask, sparse=False), expected)


def test_dgc_compresses_at_least_450x_at_density_0_001() -> None:
    x = distinct_values(100, 1000, seed=0)
    wire: list[int] = []
    out = run_locally(DGC(warmup_steps=0, density=0.001).exchange(x, Slot("w", 0, 1)), wire)
    assert wire == [100 * 4 + 100 * 4]  # fp32 values + int32 indices
    assert x.numel() * 4 / sum(wire) >= 450
    assert int((out.mean != 0).sum()) == 100
    kept = out.mean.reshape(-1) != 0
    assert torch.equal(out.mean.reshape(-1)[kept], x.reshape(-1)[kept])


def test_dgc_warmup_schedule() -> None:
    assert warmup_stages(0.001) == [0.25, 0.0625, 0.015625, 0.00390625]
    dgc = DGC(density=0.001, warmup_steps=8)
    densities = [dgc.density_at(Slot("w", step, 1)) for step in range(10)]
    assert densities == [0.25] * 2 + [0.0625] * 2 + [0.015625] * 2 + [0.00390625] * 2 + [0.001] * 2
    assert DGC(density=0.3, warmup_steps=8).density_at(Slot("w", 0, 1)) == 0.3
    assert DGC(warmup_steps=0, density=0.001).density_at(Slot("w", 0, 1)) == 0.001
    # by default DGC warms up as the paper trains: 1000 steps from 25 %
    default = DGC(density=0.001)
    assert default.warmup_steps == 1000 and default.density_at(Slot("w", 0, 1)) == 0.25
    assert default.density_at(Slot("w", 999, 1)) > 0.001 == default.density_at(Slot("w", 1000, 1))
    # the warm-up density decides how many entries travel
    x = distinct_values(100, 100, seed=1)
    wire: list[int] = []
    run_locally(dgc.exchange(x, Slot("w", 0, 1)), wire)
    assert wire == [2500 * 8]


def test_dgc_refuses_an_optimizer_with_its_own_momentum() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"momentum.*SGD\(momentum=0\)"):
        DGC().check_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match="betas"):
        DGC().check_optimizer(torch.optim.Adam(params))
    DGC().check_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0))
    DGC(momentum=0).check_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))


def test_one_dimensional_tensors_go_dense() -> None:
    vector, matrix = torch.randn(1000), torch.randn(40, 50)
    for comp in (TopK(), DGC(), RandomK(), PowerSGD()):
        assert not comp.compresses(vector)
        assert comp.compresses(matrix)
    assert not PowerSGD(rank=1).compresses(torch.randn(3, 3))  # (3+3)*2 > 9: not worth it
    assert not PowerSGD(rank=4).compresses(torch.randn(10, 10))


def test_dgc_state_dict_round_trip_continues_the_sample_offsets() -> None:
    x = distinct_values(200, 500, seed=7)
    first = DGC(warmup_steps=0, density=0.01, sample_fraction=0.05, seed=5)
    for step in range(3):
        first.select(x.reshape(-1), 1000, Slot("w", step, 1))
    second = DGC(warmup_steps=0, density=0.01, sample_fraction=0.05, seed=99)
    second.load_state_dict(first.state_dict())
    counts = []
    for comp in (first, second):
        comp.select(x.reshape(-1), 1000, Slot("w", 3, 1))
        counts.append(comp.last_candidates)
    assert counts[0] == counts[1]
    assert torch.equal(first.generator.get_state(), second.generator.get_state())


# -- error feedback -----------------------------------------------------------------------


def residual_of(memory: Memory, key: str) -> Tensor:
    """What a memory holds back for ``key``."""
    if isinstance(memory, DGCMemory):
        return memory.accumulators[key]
    assert isinstance(memory, ResidualMemory)
    return memory.residuals[key]


@pytest.mark.parametrize(
    ("comp", "memory"),
    [
        (TopK(density=0.05), ResidualMemory()),
        (
            DGC(warmup_steps=0, density=0.05, sample_fraction=0.2),
            DGCMemory(momentum=0.0, masking=False),
        ),
        (
            DGC(warmup_steps=0, density=0.05, sample_fraction=0.2, selection="threshold"),
            DGCMemory(momentum=0.0, masking=False),
        ),
        (RandomK(density=0.05), ResidualMemory()),
        (PowerSGD(rank=2), ResidualMemory()),
        (OneRoundPowerSGD(rank=2), ResidualMemory()),
        (OneRoundPowerSGD(rank=2, alternate=True), ResidualMemory()),
    ],
    ids=[
        "topk",
        "dgc",
        "dgc-threshold",
        "randomk",
        "powersgd",
        "powersgd-oneround",
        "powersgd-oneround-alt",
    ],
)
def test_error_feedback_conserves_mass(comp: Compressor, memory: Memory) -> None:
    gen = torch.Generator().manual_seed(1)
    total_in = torch.zeros(30, 40, dtype=torch.float64)
    total_sent = torch.zeros(30, 40, dtype=torch.float64)
    for step in range(12):
        grad = torch.randn(30, 40, generator=gen)
        total_in += grad
        slot = Slot("w", step, 1)
        corrected = memory.compensate(grad, slot)
        assert comp.compresses(corrected)
        result = run_locally(comp.exchange(corrected, slot))
        memory.update(corrected, result, slot, compressed=True)
        total_sent += result.mean
    residual = residual_of(memory, "w")
    torch.testing.assert_close(total_sent + residual, total_in, rtol=0, atol=2e-4)
    assert float(residual.abs().sum()) > 1.0  # something really was held back
    assert float(total_sent.abs().sum()) > 1.0  # and something was sent


def test_dgc_memory_matches_momentum_sgd_at_full_density() -> None:
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(6, 7, generator=gen) for _ in range(6)]
    dgc = DGC(warmup_steps=0, density=1.0, momentum=0.9, masking=False)
    memory = dgc.make_memory()
    reference = torch.nn.Parameter(torch.zeros(6, 7))
    sgd = torch.optim.SGD([reference], lr=0.1, momentum=0.9)
    weights = torch.zeros(6, 7)
    for step, grad in enumerate(grads):
        slot = Slot("w", step, 1)
        corrected = memory.compensate(grad, slot)
        result = run_locally(dgc.exchange(corrected, slot))
        memory.update(corrected, result, slot, compressed=True)
        weights -= 0.1 * result.mean  # plain SGD on what DGC sent
        reference.grad = grad.clone()
        sgd.step()
        torch.testing.assert_close(result.mean, sgd.state[reference]["momentum_buffer"])
    torch.testing.assert_close(weights, reference.detach())
    # with momentum factor masking everything sent resets the velocity: the gradient itself
    masked = DGC(warmup_steps=0, density=1.0, momentum=0.9, masking=True)
    memory = masked.make_memory()
    for step, grad in enumerate(grads):
        slot = Slot("w", step, 1)
        corrected = memory.compensate(grad, slot)
        result = run_locally(masked.exchange(corrected, slot))
        memory.update(corrected, result, slot, compressed=True)
        torch.testing.assert_close(result.mean, grad)


# -- random-k -----------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 5000), density=st.floats(0.0001, 1.0), seed=st.integers(0, 10**6))
def test_random_k_draws_k_distinct_sorted_indices(n: int, density: float, seed: int) -> None:
    k = max(1, min(n, round(n * density)))
    indices = sample_without_replacement(n, k, torch.Generator().manual_seed(seed))
    assert indices.numel() == k
    assert bool((indices[1:] > indices[:-1]).all())  # sorted and distinct
    assert int(indices[0]) >= 0 and int(indices[-1]) < n


def test_random_k_indices_are_shared_by_ranks_and_change_every_step() -> None:
    comp = RandomK(density=0.01, seed=3)
    x = torch.randn(100, 100)
    _, (rank0, _) = comp.compress(x, Slot("w", 5, 2, rank=0))
    _, (rank1, _) = RandomK(density=0.01, seed=3).compress(x, Slot("w", 5, 2, rank=1))
    assert torch.equal(rank0, rank1)
    _, (next_step, _) = comp.compress(x, Slot("w", 6, 2, rank=0))
    _, (other_key, _) = comp.compress(x, Slot("v", 5, 2, rank=0))
    _, (other_seed, _) = RandomK(density=0.01, seed=4).compress(x, Slot("w", 5, 2))
    for other in (next_step, other_key, other_seed):
        assert not torch.equal(rank0, other)


def test_random_k_two_ranks_sum_values_at_shared_indices() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(20, 30, generator=gen), torch.randn(20, 30, generator=gen)
    ranks = [RandomK(density=0.1), RandomK(density=0.1)]
    wire: list[int] = []
    results = drive(
        [c.exchange(x, Slot("w", 2, 2, r)) for r, (c, x) in enumerate(zip(ranks, (a, b)))]
    )
    run_locally(RandomK(density=0.1).exchange(a, Slot("w", 2, 1)), wire)
    assert wire == [60 * 4]  # values only
    idx = results[0].sent_indices
    assert idx is not None and torch.equal(idx, results[1].sent_indices)
    expected = torch.zeros(600)
    expected[idx] = ((a + b) / 2).reshape(-1)[idx]
    for result in results:
        torch.testing.assert_close(result.mean.reshape(-1), expected)


def test_random_k_rescaled_reports_the_scaled_values_to_error_feedback() -> None:
    grad = torch.randn(10, 20, generator=torch.Generator().manual_seed(3))
    comp, memory = RandomK(density=0.1, rescale=True), ResidualMemory()
    slot = Slot("w", 0, 1)
    corrected = memory.compensate(grad, slot)
    result = run_locally(comp.exchange(corrected, slot))
    memory.update(corrected, result, slot, compressed=True)
    kept = result.mean != 0
    torch.testing.assert_close(result.mean[kept], 10 * grad[kept])  # n/k = 10
    torch.testing.assert_close(result.mean + memory.residuals["w"], grad)


def test_random_k_rescaled_is_unbiased() -> None:
    x = torch.randn(5, 10, generator=torch.Generator().manual_seed(9))
    comp = RandomK(density=0.2, rescale=True)  # k = 10 of 50: kept entries times 5
    steps = 3000
    total = torch.zeros(5, 10)
    kept = torch.zeros(5, 10)
    for step in range(steps):
        mean = run_locally(comp.exchange(x, Slot("w", step, 1))).mean
        total += mean
        kept += mean != 0
    # each entry is kept with probability k/n = 0.2 ...
    assert float((kept / steps - 0.2).abs().max()) < 0.04
    # ... so the rescaled estimate averages to x (std per entry ~ 2|x|/sqrt(steps))
    torch.testing.assert_close(total / steps, x, rtol=0, atol=0.2 * float(x.abs().max()))
    # without rescaling it is biased toward zero by the density
    plain = RandomK(density=0.2)
    total_plain = sum(run_locally(plain.exchange(x, Slot("w", s, 1))).mean for s in range(steps))
    torch.testing.assert_close(
        total_plain / steps, 0.2 * x, rtol=0, atol=0.05 * float(x.abs().max())
    )


# -- options ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "options", "named"),
    [
        ("topk", {"density": 0}, "density"),
        ("randomk", {"density": 0}, "density"),
        ("randomk", {"density": 1.5}, "density"),
        ("randomk", {"seed": "x"}, "seed"),
        ("dgc", {"density": 0}, "density"),
        ("dgc", {"density": 1.5}, "density"),
        ("dgc", {"sample_fraction": 0}, "sample_fraction"),
        ("dgc", {"momentum": 1.0}, "momentum"),
        ("dgc", {"max_norm": 0}, "max_norm"),
        ("dgc", {"weight_decay": -1}, "weight_decay"),
        ("dgc", {"warmup_steps": -1}, "warmup_steps"),
        ("dgc", {"seed": 1.5}, "seed"),
        ("powersgd", {"rank": 0}, "rank"),
        ("powersgd", {"rank": 1.5}, "rank"),
        ("powersgd", {"min_compression": -1}, "min_compression"),
        ("powersgd-oneround", {"rank": 0}, "rank"),
        ("powersgd-oneround", {"seed": 0.5}, "seed"),
        ("powersgd-oneround", {"alternate": "yes"}, "alternate"),
    ],
)
def test_bad_options_raise_naming_the_option(name: str, options: dict[str, Any], named: str):
    with pytest.raises(ValueError, match=named):
        thinwire.compressor(name, **options)


def test_registered_by_name_with_summaries() -> None:
    listing = thinwire.compressors()
    for name, cls in (
        ("randomk", RandomK),
        ("dgc", DGC),
        ("powersgd", PowerSGD),
        ("powersgd-oneround", OneRoundPowerSGD),
    ):
        assert name in listing
        assert isinstance(thinwire.compressor(name), cls)
    assert isinstance(DGC().make_memory(), DGCMemory)
    assert isinstance(PowerSGD().make_memory(), ResidualMemory)
    assert isinstance(OneRoundPowerSGD().make_memory(), ResidualMemory)
    assert isinstance(RandomK().make_memory(), ResidualMemory)
    assert isinstance(RandomK(rescale=True).make_memory(), NoMemory)
