"""Deterministic quantizers: fp16, bf16, 1-bit SGD, signSGD and error feedback, in one process."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import thinwire
from compressor_cases import SLOT, bits_per_value, drive, randn, small_tensors
from thinwire.compress import Op, Slot, run_locally
from thinwire.compress.base import Compressor, Exchanged
from thinwire.compress.bf16 import BF16
from thinwire.compress.feedback import ResidualMemory
from thinwire.compress.fp16 import FP16
from thinwire.compress.onebit import OneBit
from thinwire.compress.signsgd import SignSGD

# -- fp16 and bf16 --------------------------------------------------------------------------

HALVES = [
    # (compressor, unit roundoff, smallest normal, a safe largest value)
    (FP16, 2**-11, 2**-14, 65504.0),
    (BF16, 2**-8, 2**-126, 2.0**126),
]


@pytest.mark.parametrize(("cls", "roundoff", "smallest", "largest"), HALVES, ids=["fp16", "bf16"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_half_precision_round_trip_is_within_one_rounding(
    data: st.DataObject, cls: type[Compressor], roundoff: float, smallest: float, largest: float
) -> None:
    magnitude, sign = st.floats(smallest, largest, width=32), st.sampled_from([-1.0, 1.0])
    values = data.draw(st.lists(st.tuples(magnitude, sign), min_size=1, max_size=50))
    x = torch.tensor([m * s for m, s in values])
    result = run_locally(cls().exchange(x, SLOT))
    assert bool(((result.mean - x).abs() <= roundoff * x.abs()).all())
    assert torch.equal(result.local, result.mean)


@pytest.mark.parametrize(("cls", "dtype"), [(FP16, torch.float16), (BF16, torch.bfloat16)])
def test_half_precision_sends_16_bits_per_value_in_one_sum(
    cls: type[Compressor], dtype: torch.dtype
) -> None:
    x = randn(1000)
    request = cls().exchange(x, SLOT).send(None)
    assert request.op is Op.SUM
    assert [t.dtype for t in request.tensors] == [dtype]
    assert bits_per_value(cls(), x) == 16.0


def test_fp16_divides_before_the_sum_so_it_stays_in_range() -> None:
    # 4 ranks near fp16's largest value: a sum of undivided payloads would overflow to inf.
    xs = [torch.tensor([60000.0, -60000.0, 3.0]) + rank for rank in range(4)]
    results = drive([FP16().exchange(x, Slot("w", 0, 4, rank)) for rank, x in enumerate(xs)])
    exact = torch.stack(xs).mean(0)
    for result in results:
        assert bool(torch.isfinite(result.mean).all())
        assert bool(((result.mean - exact).abs() <= 4 * 2**-11 * exact.abs()).all())
    torch.testing.assert_close(results[2].local, xs[2], rtol=2**-11, atol=0)


def test_fp16_divides_before_casting_so_large_gradients_survive() -> None:
    # 100000 is beyond fp16 (65504) but 100000 / 4 is not, and neither is the mean.
    xs = [torch.tensor([100_000.0]), torch.tensor([-90_000.0]), torch.tensor([10.0])]
    xs.append(torch.tensor([10.0]))
    results = drive([FP16().exchange(x, Slot("w", 0, 4, rank)) for rank, x in enumerate(xs)])
    # Each payload and each partial sum rounds once, and none exceeds sum |x_r| / N.
    bound = 2 * 2**-11 * sum(float(x.abs().sum()) for x in xs) / 4
    torch.testing.assert_close(results[0].mean, torch.tensor([2505.0]), rtol=0, atol=bound)
    torch.testing.assert_close(results[0].local, xs[0], rtol=2**-11, atol=0)


# -- 1-bit SGD ------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(x=small_tensors)
def test_onebit_keeps_signs_and_the_mean_of_each_sign_group(x: Tensor) -> None:
    compressor = OneBit()
    decoded = run_locally(compressor.exchange(x, SLOT)).mean
    plus = x >= 0
    assert bool((decoded[x > 0] > 0).all()) and bool((decoded[x < 0] < 0).all())
    for group in (plus, ~plus):
        if bool(group.any()):
            values = decoded[group]
            assert bool((values == values[0]).all())  # one value per sign group
            group_mean = x[group].double().mean()
            error = abs(float(values[0]) - float(group_mean))
            assert error <= 1e-6 * abs(float(group_mean)) + 1e-44  # + a subnormal's spacing
    payload, numel = compressor.compress(x, SLOT)
    assert torch.equal(compressor.decompress(payload, numel), decoded)


@pytest.mark.parametrize("numel", [1000, 1001, 4096, 100_000])
def test_onebit_sends_at_most_1_1_bits_per_value(numel: int) -> None:
    bits = bits_per_value(OneBit(), randn(numel))
    assert bits == 8 * (math.ceil(numel / 8) + 8) / numel  # packed signs + two fp32 scales
    assert bits <= 1.1


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 20),
    cols=st.integers(64, 77),
    scales=st.lists(st.floats(1e-3, 1e3), min_size=20, max_size=20),
    seed=st.integers(0, 2**16),
)
def test_onebit_per_row_keeps_signs_and_the_mean_of_each_rows_sign_groups(
    rows: int, cols: int, scales: list[float], seed: int
) -> None:
    x = randn(rows * cols, seed=seed).view(rows, cols) * torch.tensor(scales[:rows]).view(-1, 1)
    compressor = OneBit(per_row=True)
    decoded = run_locally(compressor.exchange(x, SLOT)).mean
    assert decoded.shape == x.shape
    assert bool((decoded[x > 0] > 0).all()) and bool((decoded[x < 0] < 0).all())
    for row, decoded_row in zip(x, decoded, strict=True):
        for group in (row >= 0, row < 0):
            if bool(group.any()):
                group_mean = float(row[group].double().mean())
                torch.testing.assert_close(
                    decoded_row[group].double(),
                    torch.full((int(group.sum()),), group_mean, dtype=torch.float64),
                    rtol=1e-6,
                    atol=1e-30,
                )
    payload, numel = compressor.compress(x, SLOT)
    assert payload[1].shape == (rows, 2)
    assert torch.equal(compressor.decompress(payload, numel).view_as(x), decoded)


def test_onebit_per_row_keeps_small_rows_small() -> None:
    # One scale pair for the whole tensor decodes the small rows at the large rows' size.
    x = randn(64 * 300, seed=3).view(64, 300) * torch.logspace(-3, 1, 64).view(-1, 1)
    row_errors = {
        per_row: (run_locally(OneBit(per_row=per_row).exchange(x, SLOT)).local - x).norm(dim=1)
        for per_row in (False, True)
    }
    row_norms = x.norm(dim=1)
    assert bool((row_errors[True] < row_norms).all())  # better than sending nothing, every row
    assert bool((row_errors[False][:8] > 10 * row_norms[:8]).all())


@pytest.mark.parametrize("shape", [(100,), (512, 3), (64, 1, 3, 3), (10, 63)], ids=str)
def test_onebit_per_row_keeps_one_pair_for_vectors_and_short_rows(shape: tuple[int, ...]) -> None:
    # Scales per row of fewer than 64 values would cost more than the signs.
    x = randn(math.prod(shape), seed=4).view(shape)
    payload, _ = OneBit(per_row=True).compress(x, SLOT)
    assert payload[1].shape == (2,)
    per_row = run_locally(OneBit(per_row=True).exchange(x, SLOT)).mean
    one_pair = run_locally(OneBit(per_row=False).exchange(x, SLOT)).mean
    assert torch.equal(per_row, one_pair)


@pytest.mark.parametrize(
    ("shape", "dtype", "transpose"),
    [
        ((130, 8065), torch.float32, False),  # several blocks of 128 rows
        ((9, 131_073), torch.float32, False),  # blocks of 8 long rows
        ((96, 200), torch.float32, True),  # not contiguous
        ((72, 100), torch.float64, False),
        ((72, 100), torch.float16, False),
        ((72, 100), torch.bfloat16, False),
    ],
    ids=str,
)
def test_onebit_per_row_decodes_each_row_to_its_group_means(
    shape: tuple[int, int], dtype: torch.dtype, transpose: bool
) -> None:
    x = (randn(math.prod(shape), seed=6).view(shape) * torch.rand(shape[0], 1) * 4).to(dtype)
    if transpose:
        x = x.t()
    decoded = run_locally(OneBit(per_row=True).exchange(x, SLOT)).local
    assert decoded.dtype == dtype and decoded.shape == x.shape
    wide = x.double()
    plus = wide >= 0
    count = plus.sum(1, keepdim=True).clamp_min(1)
    a = wide.clamp(min=0).sum(1, keepdim=True) / count
    b = -wide.clamp(max=0).sum(1, keepdim=True) / (wide.shape[1] - count).clamp_min(1)
    expected = torch.where(plus, a, -b)
    tolerance = {torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(dtype, 1e-5)
    torch.testing.assert_close(decoded.double(), expected, rtol=tolerance, atol=0)


def test_onebit_per_row_sends_8_more_bytes_per_row() -> None:
    x = randn(256 * 2304).view(256, 2304)  # a 3x3 convolution of 256 input channels
    bits = bits_per_value(OneBit(per_row=True), x)
    assert bits == 8 * (256 * 2304 / 8 + 8 * 256) / x.numel()
    assert bits < 1.03


def test_onebit_per_row_mean_is_the_average_of_what_each_rank_sent() -> None:
    xs = [randn(40 * 70, seed=rank).view(40, 70) * (rank + 1) for rank in range(3)]
    compressors = [OneBit(per_row=True) for _ in xs]
    results = drive(
        [c.exchange(x, Slot("w", 0, 3, r)) for r, (c, x) in enumerate(zip(compressors, xs))]
    )
    assert [c.compress(x, SLOT)[0][1].shape for c, x in zip(compressors, xs)] == [(40, 2)] * 3
    expected = sum(r.local for r in results) / 3
    for result in results:
        torch.testing.assert_close(result.mean, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(result.mean, results[0].mean)


def test_onebit_per_row_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="per_row must be true or false"):
        thinwire.compressor("onebit", per_row="yes")


# -- signSGD --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(x=small_tensors)
def test_signsgd_sends_sign_times_mean_magnitude(x: Tensor) -> None:
    compressor = SignSGD()
    local = run_locally(compressor.exchange(x, SLOT)).local
    expected = torch.where(x >= 0, 1.0, -1.0) * x.abs().mean()
    torch.testing.assert_close(local, expected, rtol=1e-6, atol=0)
    payload, numel = compressor.compress(x, SLOT)
    assert torch.equal(compressor.decompress(payload, numel), local)


@pytest.mark.parametrize("numel", [1000, 4096])
def test_signsgd_sends_about_one_bit_per_value(numel: int) -> None:
    bits = bits_per_value(SignSGD(), randn(numel))
    assert bits == 8 * (math.ceil(numel / 8) + 4) / numel  # packed signs + one fp32 scale
    assert bits <= 1.04


def vote(xs: Sequence[Tensor]) -> list[Exchanged]:
    """signSGD's exchange on one rank per tensor of ``xs``."""
    world = len(xs)
    return drive([SignSGD().exchange(x, Slot("w", 0, world, rank)) for rank, x in enumerate(xs)])


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 5), numel=st.integers(1, 30), seed=st.integers(0, 10_000))
def test_signsgd_majority_vote(world: int, numel: int, seed: int) -> None:
    xs = [randn(numel, seed=seed + rank) for rank in range(world)]
    results = vote(xs)
    votes = sum(torch.where(x >= 0, 1.0, -1.0) for x in xs)
    scale = torch.stack([x.abs().mean() for x in xs]).mean()
    for result in results:
        torch.testing.assert_close(result.mean, votes.sign() * scale, rtol=1e-6, atol=0)


def test_signsgd_vote_counts_ranks_not_magnitudes_and_ties_give_zero() -> None:
    three = vote([torch.tensor([10.0, 1.0]), torch.tensor([-1.0, 1.0]), torch.tensor([-1.0, -9.0])])
    scale = (5.5 + 1.0 + 5.0) / 3
    torch.testing.assert_close(three[0].mean, torch.tensor([-scale, scale]))  # 1 for, 2 against
    four = vote([torch.tensor([1.0, 2.0])] * 2 + [torch.tensor([-1.0, 2.0])] * 2)
    torch.testing.assert_close(four[0].mean, torch.tensor([0.0, 1.5]))


# -- error feedback -------------------------------------------------------------------------


@pytest.mark.parametrize("compressor", [OneBit(), SignSGD()], ids=repr)
def test_error_feedback_conserves_mass(compressor: Compressor) -> None:
    memory = compressor.make_memory()
    assert isinstance(memory, ResidualMemory)
    total_in, total_sent = torch.zeros(20, 30), torch.zeros(20, 30)
    for step in range(10):
        grad = randn(20, 30, seed=step) + 0.3  # a drift the residual has to carry
        total_in += grad
        slot = Slot("w", step, 1)
        corrected = memory.compensate(grad, slot)
        before = corrected.clone()
        result = run_locally(compressor.exchange(corrected, slot))
        assert torch.equal(corrected, before)
        memory.update(corrected, result, slot, compressed=True)
        total_sent += result.mean  # what the receivers got
    residual = memory.residuals["w"]
    torch.testing.assert_close(total_sent + residual, total_in, rtol=0, atol=1e-4)
    assert float(residual.abs().sum()) > 1.0  # something really was held back
    assert float(residual.norm()) < float(total_in.norm()) / 3  # and most of it was sent
