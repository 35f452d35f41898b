"""Stochastic quantizers: TernGrad and QSGD, per tensor and per row, in one process."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from compressor_cases import SLOT, bits_per_value, drive, randn, small_tensors
from thinwire.compress import Op, Slot, run_locally
from thinwire.compress.base import Compressor
from thinwire.compress.bits import unpack
from thinwire.compress.onebit import OneBit
from thinwire.compress.qsgd import QSGD
from thinwire.compress.signsgd import SignSGD
from thinwire.compress.stochastic import RankStream
from thinwire.compress.terngrad import TernGrad, ternary_codes


def bernstein_tolerance(variance: Tensor, spread: Tensor, draws: int, delta: float) -> Tensor:
    """The ε for which Bernstein's inequality bounds the chance that the mean of ``draws``
    independent copies of a variable with this ``variance`` and ``|X - E X| <= spread``
    misses ``E X`` by ε or more by ``delta``: 2 exp(-K ε² / (2 σ² + 2 R ε / 3)) = δ."""
    log_term = math.log(2 / delta)
    linear = spread * log_term / (3 * draws)
    return linear + torch.sqrt(linear**2 + 2 * variance * log_term / draws)


def average_decodes(compressor: Compressor, x: Tensor, draws: int) -> Tensor:
    """The mean, in fp64, of ``draws`` decodes of ``x`` (consecutive steps of one rank)."""
    total = torch.zeros(x.shape, dtype=torch.float64)
    for step in range(draws):
        total += run_locally(compressor.exchange(x, Slot("w", step, 1))).mean.double()
    return total / draws


# -- TernGrad -------------------------------------------------------------------------------


def clipped(x: Tensor, sigma: float = 2.5) -> Tensor:
    """TernGrad's clipping, computed independently: at ``sigma`` root-mean-squares."""
    bound = sigma * float(x.double().square().mean().sqrt())
    return x.double().clamp(-bound, bound)


@settings(max_examples=80, deadline=None)
@given(x=small_tensors)
def test_terngrad_sends_the_shared_scaler_times_a_ternary(x: Tensor) -> None:
    c = clipped(x)
    s = float(c.abs().max())
    decoded = run_locally(TernGrad().exchange(x, SLOT)).mean.double()
    magnitudes = set(decoded.abs().tolist()) - {0.0}
    assert len(magnitudes) <= 1  # every entry is -s, 0 or s
    assert all(m == pytest.approx(s, rel=1e-6) for m in magnitudes)
    assert bool((decoded * c >= 0).all())  # a ternary never has the wrong sign
    peak = c.abs() == s
    torch.testing.assert_close(decoded[peak], c[peak], rtol=1e-6, atol=0)  # probability 1


def test_terngrad_clips_outliers_at_2_5_root_mean_squares() -> None:
    x = randn(1000)
    x[17] = 100.0
    with_clip = run_locally(TernGrad().exchange(x, SLOT)).mean
    bound = 2.5 * float(x.square().mean().sqrt())
    assert float(with_clip.abs().max()) == pytest.approx(bound, rel=1e-6)
    without = run_locally(TernGrad(clip_sigma=None).exchange(x, SLOT)).mean
    assert float(without.abs().max()) == 100.0


def test_terngrad_shares_the_largest_scaler_through_a_max_round() -> None:
    xs = [randn(200, seed=1), 10 * randn(200, seed=2)]
    first = TernGrad().exchange(xs[0], Slot("w", 0, 2)).send(None)
    assert first.op is Op.MAX and first.tensors[0].numel() == 1
    protocols = [
        TernGrad(clip_sigma=None).exchange(x, Slot("w", 0, 2, r)) for r, x in enumerate(xs)
    ]
    results = drive(protocols)
    s = float(torch.stack([x.abs().max() for x in xs]).max())
    for result in results:
        assert set(result.local.abs().unique().tolist()) <= {0.0, s}
    assert float(results[0].local.abs().max()) == s  # rank 0 uses rank 1's larger scaler


@pytest.mark.parametrize("numel", [1000, 1001, 65_536])
def test_terngrad_sends_at_most_2_1_bits_per_value(numel: int) -> None:
    wire: list[int] = []
    run_locally(TernGrad().exchange(randn(numel), SLOT), wire)
    assert wire == [4, math.ceil(numel / 4)]  # the scaler, then 2-bit codes
    assert 8 * sum(wire) / numel <= 2.1


DRAWS = 2000
TILES = 50_000
DELTA = 1e-9  # per entry and example: a correct implementation fails with this chance


@settings(max_examples=25, deadline=None)
@given(x=small_tensors, clip=st.booleans(), seed=st.integers(0, 2**31))
def test_terngrad_is_unbiased_for_the_clipped_tensor(x: Tensor, clip: bool, seed: int) -> None:
    # TILES copies of x in one tensor have x's clip bound and scaler, so one exchange
    # gives TILES independent draws of every entry.
    compressor = TernGrad(clip_sigma=2.5 if clip else None, seed=seed)
    c = clipped(x) if clip else x.double()
    s = c.abs().max()
    decoded = run_locally(compressor.exchange(x.repeat(TILES), SLOT)).mean
    average = decoded.view(TILES, -1).double().mean(0)
    # s t is ±s with probability |c|/s, else 0: variance s|c| - c², range s.
    variance = s * c.abs() - c.square()
    tolerance = bernstein_tolerance(variance, s, TILES, DELTA) + 1e-5 * s
    assert bool(((average - c).abs() <= tolerance).all()), (average - c).abs() / tolerance


def test_terngrad_average_over_steps_converges_to_the_clipped_tensor() -> None:
    x = torch.tensor([0.3, -0.05, 0.0, 1.0, -0.7, 0.01])
    c = clipped(x)
    s = c.abs().max()
    tolerance = bernstein_tolerance(s * c.abs() - c.square(), s, DRAWS, DELTA) + 1e-6 * s
    assert bool(((average_decodes(TernGrad(), x, DRAWS) - c).abs() <= tolerance).all())


class EveryNoise(RankStream):
    """A stream whose 16-bit lanes count 0, 1, ..., 65535 over and over: every value of the
    noise v equally often in each run of 65536 entries (chunks start at multiples of it)."""

    def words_(self, out: Tensor, slot: Slot) -> Tensor:
        lanes = torch.arange(out.numel() * 4, dtype=torch.int32) % 65536
        out.view(torch.int16).copy_(lanes.to(torch.int16))
        return out


def test_terngrad_rounds_with_the_exact_probability_to_within_2_to_the_minus_16() -> None:
    # Each c/s repeated over all 65536 noise values gives the exact chance of t = sign(c).
    ratios = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, -0.25, 1e-6, -3e-5, 2**-16, 0.999999])
    ratios = torch.cat([ratios, torch.rand(22, generator=torch.Generator().manual_seed(3)) * 2 - 1])
    codes = ternary_codes(ratios.repeat_interleave(65536), None, 1.0, EveryNoise(0, "t"), SLOT)
    t = unpack(codes, 2, ratios.numel() * 65536).view(-1, 65536).long() - 1
    assert bool(((t == 0) | (t == ratios.sign().long().view(-1, 1))).all())  # never the wrong sign
    chance = t.double().mean(1)
    assert bool(((chance - ratios.double()).abs() <= 2**-16).all()), chance - ratios
    assert bool((t[:2] == 0).all()) and bool((t[2] == 1).all()) and bool((t[3] == -1).all())


@settings(max_examples=40, deadline=None)
@given(x=small_tensors, seed=st.integers(0, 2**31), clip=st.booleans())
def test_terngrad_codes_are_the_rounded_sum_computed_exactly(
    x: Tensor, seed: int, clip: bool
) -> None:
    # Replay the stream: t = round(c / s + v) in fp64, v = (odd 16-bit word) / 2**16.
    bound = 2.5 * float(x.square().mean().sqrt()) if clip else None
    c = x.double().clamp(-bound, bound) if bound is not None else x.double()
    s = float(c.abs().max())
    codes = ternary_codes(x, bound, s, RankStream(seed, "t"), SLOT)
    words = RankStream(seed, "t").words_(torch.empty(-(-x.numel() // 4), dtype=torch.int64), SLOT)
    v = (words | 0x0001_0001_0001_0001).view(torch.int16)[: x.numel()].double() / 2**16
    exact = c / s + v if s > 0 else v
    t = unpack(codes, 2, x.numel()).double() - 1
    # fp32 arithmetic may round the other way only within a hair of a half-integer
    near_tie = ((exact.abs() - 0.5).abs() < 1e-5) & (c != 0)
    assert torch.equal(t[~near_tie], torch.round(exact)[~near_tie])
    assert bool(((t - exact).abs() <= 0.5 + 1e-5).all())


def clipped_rows(x: Tensor, sigma: float | None = 2.5) -> Tensor:
    """TernGrad's per-row clipping, computed independently in fp64."""
    x = x.double()
    if sigma is None:
        return x
    bound = sigma * x.square().mean(1, keepdim=True).sqrt()
    return torch.minimum(torch.maximum(x, -bound), bound)


def rows_of_mixed_scale(rows: int, cols: int, seed: int = 0) -> Tensor:
    """A matrix whose rows are normal with standard deviations from 1e-3 to 10."""
    return randn(rows, cols, seed=seed) * torch.logspace(-3, 1, rows).unsqueeze(1)


def test_terngrad_per_row_shares_each_rows_largest_scaler() -> None:
    xs = [rows_of_mixed_scale(8, 100, seed=1), 3 * rows_of_mixed_scale(8, 100, seed=2)]
    first = TernGrad(per_row=True).exchange(xs[0], Slot("w", 0, 2)).send(None)
    assert first.op is Op.MAX and first.tensors[0].shape == (8,)  # a scaler per row
    protocols = [
        TernGrad(per_row=True, seed=r).exchange(x, Slot("w", 0, 2, r)) for r, x in enumerate(xs)
    ]
    results = drive(protocols)
    s = torch.stack([clipped_rows(x).abs().amax(1) for x in xs]).amax(0)  # per row, over ranks
    for result in results:
        for row, scaler in zip(result.local.double(), s, strict=True):
            magnitudes = row.abs().unique()
            assert magnitudes[0] == 0 and len(magnitudes) == 2  # every entry is 0 or ±s_j
            assert float(magnitudes[1]) == pytest.approx(float(scaler), rel=1e-6)
        assert torch.equal(result.mean, results[0].mean)
    torch.testing.assert_close(results[0].mean, (results[0].local + results[1].local) / 2)
    # with one scaler per tensor a small row rounds almost all to zero; per row, the rank
    # that holds the row's largest entries sends about E|c| / s ~ 0.3 of it nonzero
    assert all(float((row != 0).float().mean()) > 0.15 for row in results[1].local)
    per_tensor = drive(
        [TernGrad(per_row=False, seed=r).exchange(x, Slot("w", 0, 2, r)) for r, x in enumerate(xs)]
    )
    assert float((per_tensor[1].local[0] != 0).float().mean()) < 0.01


@settings(max_examples=8, deadline=None)
@given(
    rows=st.integers(1, 4),
    cols=st.integers(64, 80),
    clip=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_terngrad_per_row_is_unbiased_for_each_clipped_row(
    rows: int, cols: int, clip: bool, seed: int
) -> None:
    # TILES copies of the matrix stacked as more rows keep every row's bound and scaler.
    tiles = 4000
    x = rows_of_mixed_scale(rows, cols, seed=seed % 1000)
    compressor = TernGrad(clip_sigma=2.5 if clip else None, seed=seed, per_row=True)
    c = clipped_rows(x, 2.5 if clip else None)
    s = c.abs().amax(1, keepdim=True)
    decoded = run_locally(compressor.exchange(x.repeat(tiles, 1), SLOT)).mean
    average = decoded.view(tiles, rows, cols).double().mean(0)
    tolerance = bernstein_tolerance(s * c.abs() - c.square(), s, tiles, DELTA) + 1e-5 * s
    assert bool(((average - c).abs() <= tolerance).all()), (average - c).abs() / tolerance


@pytest.mark.parametrize(
    ("shape", "scalers"),
    [
        ((16, 64), 16),
        ((8, 8, 3, 3), 8),
        ((8, 4, 3, 3), 1),
        ((16, 63), 1),
        ((1000,), 1),
        ((0, 64), 1),
    ],
)
def test_terngrad_per_row_sends_a_scaler_per_long_enough_row(
    shape: tuple[int, ...], scalers: int
) -> None:
    numel = math.prod(shape)
    wire: list[int] = []
    run_locally(TernGrad(per_row=True).exchange(randn(*shape), SLOT), wire)
    assert wire == [4 * scalers, math.ceil(numel / 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_terngrad_per_row_keeps_the_dtype_and_zero_rows(dtype: torch.dtype) -> None:
    x = rows_of_mixed_scale(8, 100)
    x[3] = 0.0
    result = run_locally(TernGrad(per_row=True).exchange(x.to(dtype), SLOT))
    assert result.mean.dtype == dtype and result.mean.shape == x.shape
    assert not bool(result.mean[3].any())  # a zero row: s = 0, nothing sent
    s = clipped_rows(x.to(dtype)).abs().amax(1)
    for j in (0, 7):
        magnitudes = result.mean[j].double().abs().unique().tolist()
        assert magnitudes[-1] == pytest.approx(float(s[j].to(dtype)), rel=1e-2)
        assert len(magnitudes) == 2  # 0 and s_j


# -- QSGD -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("levels", "bits"), [(1, 2), (2, 4), (7, 4), (8, 8), (127, 8)])
def test_qsgd_packs_codes_in_the_fewest_bits(levels: int, bits: int) -> None:
    numel = 1000
    measured = bits_per_value(QSGD(levels=levels), randn(numel))
    assert measured == 8 * (math.ceil(numel * bits / 8) + 4) / numel  # codes + fp32 norm
    assert measured <= bits + 0.04


@settings(max_examples=60, deadline=None)
@given(x=small_tensors, levels=st.sampled_from([1, 2, 7, 8, 127]))
def test_qsgd_rounds_to_a_neighbouring_level(x: Tensor, levels: int) -> None:
    compressor = QSGD(levels=levels)
    decoded = run_locally(compressor.exchange(x, SLOT)).mean.double()
    norm = float(x.double().norm())
    if norm == 0:
        assert not bool(decoded.any())
        return
    scaled, exact = decoded / norm * levels, x.double() / norm * levels
    torch.testing.assert_close(scaled, scaled.round(), rtol=0, atol=1e-4)  # on the grid
    assert bool((scaled.abs() <= levels + 1e-4).all())
    assert bool(((scaled - exact).abs() < 1 + 1e-4).all())  # floor or ceil of the exact level
    assert bool((decoded * x >= 0).all())
    payload, numel = compressor.compress(x, SLOT)  # the next draw, decoded the same way
    decoded_again = compressor.decompress(payload, numel)
    assert torch.equal(decoded_again, qsgd_decode(payload, levels, numel))


def qsgd_decode(payload: Sequence[Tensor], levels: int, numel: int) -> Tensor:
    """QSGD's decode, computed independently: ``norm / s * (code - s)``."""
    packed, norm = payload
    bits = 2 if levels == 1 else 4 if levels <= 7 else 8
    codes = [(int(b) >> shift) & (2**bits - 1) for b in packed for shift in range(0, 8, bits)]
    signed = torch.tensor(codes[:numel], dtype=torch.float32) - levels
    return signed * (norm / levels)


@settings(max_examples=8, deadline=None)
@given(x=small_tensors, levels=st.sampled_from([1, 3, 7, 100]), seed=st.integers(0, 2**31))
def test_qsgd_is_unbiased(x: Tensor, levels: int, seed: int) -> None:
    compressor = QSGD(levels=levels, seed=seed)
    exact = x.double()
    step = exact.norm() / levels  # one level, in the units of x
    fraction = torch.frac(exact.abs() / step) if float(step) > 0 else torch.zeros_like(exact)
    # Rounded up with probability p (the fraction), else down: variance step² p (1 - p).
    variance = step**2 * fraction * (1 - fraction)
    tolerance = bernstein_tolerance(variance, step, DRAWS, DELTA) + 1e-5 * step
    average = average_decodes(compressor, x, DRAWS)
    assert bool(((average - exact).abs() <= tolerance).all()), (average - exact).abs() / tolerance


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1.0, 1e20, 1e30])
def test_norms_survive_tiny_and_huge_gradients(scale: float) -> None:
    # The squares of these entries under- or overflow fp32; the norms must not.
    x = randn(200, seed=4) * scale
    exact = x.double()
    levels = 7
    qsgd = run_locally(QSGD(levels=levels).exchange(x, SLOT)).mean.double()
    scaled, target = qsgd / exact.norm() * levels, exact / exact.norm() * levels
    assert bool(((scaled - target).abs() < 1 + 1e-4).all())  # a neighbouring level
    assert bool(qsgd.any())
    ternary = run_locally(TernGrad().exchange(x, SLOT)).mean.double()
    magnitudes = set(ternary.abs().tolist()) - {0.0}
    assert len(magnitudes) == 1
    assert magnitudes.pop() == pytest.approx(float(clipped(x).abs().max()), rel=1e-5)


def test_scales_stay_accurate_for_long_tensors() -> None:
    # fp32 reductions over millions of entries can drift by 1e-3; the scales must not.
    x = randn(3_000_000, seed=5) + 0.5
    exact = x.double()
    (_, onebit_scales), _ = OneBit(per_row=False).compress(x, SLOT)
    plus = exact >= 0
    expected = torch.stack([exact[plus].mean(), -exact[~plus].mean()])
    torch.testing.assert_close(onebit_scales.double(), expected, rtol=1e-6, atol=0)
    (_, sign_scale), _ = SignSGD().compress(x, SLOT)
    torch.testing.assert_close(
        sign_scale.double(), exact.abs().mean().reshape(1), rtol=1e-6, atol=0
    )
    (_, norm), _ = QSGD().compress(x, SLOT)
    torch.testing.assert_close(norm.double(), exact.norm().reshape(1), rtol=1e-6, atol=0)
    ternary = run_locally(TernGrad().exchange(x, SLOT)).mean  # s is the clip bound here
    bound = float(clipped(x).abs().max())
    assert float(ternary.abs().max()) == pytest.approx(bound, rel=1e-6)
