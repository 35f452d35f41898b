"""Quantizers: fp16, bf16, 1-bit SGD, signSGD, TernGrad and QSGD, in one process.

Several ranks are simulated by driving one exchange protocol per rank by hand and answering
each round as a communicator would: a sum, a maximum, or every rank's payload.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import thinwire
import thinwire.compress.bits
from thinwire.compress import Op, Slot, run_locally
from thinwire.compress.base import Compressor, Exchange, Exchanged
from thinwire.compress.bf16 import BF16
from thinwire.compress.bits import CHUNK, OutputBuffers, decode, pack, packed_size, unpack
from thinwire.compress.feedback import NoMemory, ResidualMemory
from thinwire.compress.fp16 import FP16
from thinwire.compress.onebit import OneBit, decode_signs
from thinwire.compress.onebit import encode as onebit_encode
from thinwire.compress.onebit import encode_rows as onebit_encode_rows
from thinwire.compress.qsgd import QSGD
from thinwire.compress.signsgd import SignSGD
from thinwire.compress.simulated import drive_ranks
from thinwire.compress.stochastic import RankStream
from thinwire.compress.terngrad import TernGrad, ternary_codes

SLOT = Slot("w", 0, 1)
ALL = [FP16, BF16, OneBit, SignSGD, TernGrad, QSGD]
STOCHASTIC = [TernGrad, QSGD]

#: Small fp32 tensors with zeros, ties and a wide spread of magnitudes (no subnormals:
#: their group means and norms underflow, which says nothing about the algorithms).
small_tensors = st.lists(
    st.floats(-100, 100, width=32, allow_subnormal=False) | st.sampled_from([0.0, -0.0, 1.0, -1.0]),
    min_size=1,
    max_size=24,
).map(lambda values: torch.tensor(values, dtype=torch.float32))


def randn(*shape: int, seed: int = 0) -> Tensor:
    """A reproducible standard normal tensor."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def bits_per_value(compressor: Compressor, x: Tensor) -> float:
    """Bits this rank puts on the wire per value of ``x``, over every round."""
    wire: list[int] = []
    run_locally(compressor.exchange(x, SLOT), wire)
    return 8 * sum(wire) / x.numel()


def drive(protocols: Sequence[Exchange]) -> list[Exchanged]:
    """Run one protocol per rank in lock-step, answering each round like a communicator
    (a sum in the payload's dtype, a maximum, or every rank's tensors); every rank gets its
    own copy of the answer."""
    return drive_ranks(protocols)[0]


def _copy(answer: Any) -> Any:
    if isinstance(answer, Tensor):
        return answer.clone()
    return [_copy(item) for item in answer]


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


# -- every compressor -----------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALL, ids=lambda cls: cls.name)
def test_registered_by_name_with_a_summary(cls: type[Compressor]) -> None:
    built = thinwire.compressor(cls.name)
    assert type(built) is cls
    assert len(cls.summary) > 20


@pytest.mark.parametrize("cls", ALL, ids=lambda cls: cls.name)
def test_input_is_left_alone_and_outputs_are_fresh(cls: type[Compressor]) -> None:
    x = randn(30, 7).t()  # not contiguous
    before = x.clone()
    result = run_locally(cls().exchange(x, SLOT))
    assert torch.equal(x, before)
    assert result.mean.shape == result.local.shape == x.shape
    assert result.mean.dtype == result.local.dtype == torch.float32
    for out in (result.mean, result.local):
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    # Alone in the world, the mean is what this rank sent (up to the division by N = 1).
    torch.testing.assert_close(result.mean, result.local, rtol=0, atol=0)


@pytest.mark.parametrize("cls", ALL, ids=lambda cls: cls.name)
@pytest.mark.parametrize("shape", [(0,), (4, 0), (5, 3)], ids=["empty", "empty-2d", "zeros"])
def test_zero_and_empty_tensors_give_zeros(cls: type[Compressor], shape: tuple[int, ...]) -> None:
    result = run_locally(cls().exchange(torch.zeros(shape), SLOT))
    assert result.mean.shape == shape
    assert torch.equal(result.mean, torch.zeros(shape))
    assert torch.equal(result.local, torch.zeros(shape))


@pytest.mark.parametrize("cls", ALL, ids=lambda cls: cls.name)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_non_floating_tensors_are_refused(cls: type[Compressor], dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match=rf"{dtype}.*floating-point gradients only"):
        run_locally(cls().exchange(torch.ones(6, dtype=dtype), SLOT))


@pytest.mark.parametrize(
    ("cls", "options", "message"),
    [
        (TernGrad, {"clip_sigma": 0}, r"clip_sigma must be a number > 0 or None, got 0\b"),
        (TernGrad, {"clip_sigma": -2.5}, r"clip_sigma .* got -2\.5"),
        (TernGrad, {"clip_sigma": float("nan")}, r"clip_sigma .* got nan"),
        (TernGrad, {"clip_sigma": "2.5"}, r"clip_sigma .* got '2\.5'"),
        (TernGrad, {"clip_sigma": True}, r"clip_sigma .* got True"),
        (TernGrad, {"seed": 1.5}, r"seed must be an integer, got 1\.5"),
        (TernGrad, {"per_row": 1}, r"per_row must be true or false, got 1"),
        (QSGD, {"levels": 0}, r"levels must be an integer >= 1, got 0"),
        (QSGD, {"levels": 2.5}, r"levels must be an integer >= 1, got 2\.5"),
        (QSGD, {"levels": True}, r"levels must be an integer >= 1, got True"),
        (QSGD, {"levels": 128}, r"levels must be at most 127 .*got 128"),
        (QSGD, {"seed": "7"}, r"seed must be an integer, got '7'"),
        (SignSGD, {"error_feedback": 1}, r"error_feedback must be True or False, got 1"),
    ],
)
def test_bad_options_are_refused_by_name(
    cls: type[Compressor], options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        cls(**options)


@pytest.mark.parametrize("cls", ALL, ids=lambda cls: cls.name)
def test_unknown_options_are_refused_through_the_registry(cls: type[Compressor]) -> None:
    with pytest.raises(ValueError, match=rf"{cls.name!r} has no option\(s\) density"):
        thinwire.compressor(cls.name, density=0.5)


@pytest.mark.parametrize(
    ("compressor", "memory"),
    [
        (FP16(), NoMemory),
        (BF16(), NoMemory),
        (OneBit(), ResidualMemory),
        (SignSGD(), ResidualMemory),
        (SignSGD(error_feedback=False), NoMemory),
        (TernGrad(), NoMemory),
        (QSGD(), NoMemory),
    ],
    ids=repr,
)
def test_default_error_feedback(compressor: Compressor, memory: type) -> None:
    assert type(compressor.make_memory()) is memory


@pytest.mark.parametrize("cls", [OneBit, TernGrad, QSGD], ids=lambda cls: cls.name)
def test_gathered_mean_is_the_average_of_what_each_rank_sent(cls: type[Compressor]) -> None:
    xs = [randn(50, seed=rank) * (rank + 1) for rank in range(3)]
    results = drive([cls().exchange(x, Slot("w", 0, 3, rank)) for rank, x in enumerate(xs)])
    expected = sum(r.local for r in results) / 3
    for result in results:
        torch.testing.assert_close(result.mean, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(result.mean, results[0].mean)  # bitwise the same on every rank


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


# -- private random streams (TernGrad and QSGD) ---------------------------------------------


def draw(compressor: Compressor, x: Tensor, step: int, rank: int = 0, world: int = 1) -> Tensor:
    """This rank's own decode of ``x`` at ``step`` (one draw from its stream)."""
    protocol = compressor.exchange(x, Slot("w", step, world, rank))
    if world == 1:
        return run_locally(protocol).local
    # Answer as if every rank sent the same as this one: only the local decode matters here.
    answer: Any = None
    try:
        while True:
            request = protocol.send(answer)
            same = [list(request.tensors)] * world
            answer = same if request.op is Op.GATHER else list(request.tensors)
    except StopIteration as stop:
        return stop.value.local


def test_random_words_have_every_bit_a_fair_coin() -> None:
    words = RankStream(0, "t").words_(torch.empty(20_000, dtype=torch.int64), SLOT)
    bits = (words.view(-1, 1) >> torch.arange(64)) & 1
    assert bool(((bits.double().mean(0) - 0.5).abs() < 0.02).all())  # 0.5 ± 5.6 sigma


@pytest.mark.parametrize("cls", STOCHASTIC, ids=lambda cls: cls.name)
def test_state_dict_makes_a_resumed_run_draw_the_same(cls: Callable[..., Compressor]) -> None:
    x = randn(300)
    original = cls(seed=3)
    for step in range(3):
        draw(original, x, step)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)  # a checkpoint, through the file format
    expected = [draw(original, x, step) for step in (3, 4)]
    resumed = cls(seed=3)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert all(torch.equal(draw(resumed, x, s), e) for s, e in zip((3, 4), expected))
    restarted = cls(seed=3)  # the same seed without the state starts the stream over
    assert not torch.equal(draw(restarted, x, 3), expected[0])
    with pytest.raises(ValueError, match="unknown state"):
        resumed.load_state_dict({"random": {}, "bogus": 1})


@pytest.mark.parametrize("cls", STOCHASTIC, ids=lambda cls: cls.name)
def test_ranks_draw_independently_and_reproducibly(cls: Callable[..., Compressor]) -> None:
    x = randn(300)
    rank0 = draw(cls(), x, 0, rank=0, world=2)
    rank1 = draw(cls(), x, 0, rank=1, world=2)
    assert not torch.equal(rank0, rank1)
    assert torch.equal(draw(cls(), x, 0, rank=0, world=2), rank0)
    assert not torch.equal(draw(cls(seed=1), x, 0, rank=0, world=2), rank0)


@pytest.mark.parametrize("cls", STOCHASTIC, ids=lambda cls: cls.name)
def test_the_global_random_generator_is_neither_used_nor_obeyed(
    cls: Callable[..., Compressor],
) -> None:
    x = randn(300)
    torch.manual_seed(1)
    state = torch.random.get_rng_state()
    first = draw(cls(), x, 0)
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.manual_seed(2)
    assert torch.equal(draw(cls(), x, 0), first)


@pytest.mark.parametrize("cls", STOCHASTIC, ids=lambda cls: cls.name)
def test_a_stream_refuses_to_draw_for_another_rank(cls: Callable[..., Compressor]) -> None:
    compressor = cls()
    draw(compressor, randn(10), 0, rank=0, world=2)
    with pytest.raises(ValueError, match="belongs to rank 0 but was asked to draw for rank 1"):
        draw(compressor, randn(10), 1, rank=1, world=2)
    elsewhere = cls()
    elsewhere.load_state_dict(compressor.state_dict())  # rank 0's checkpoint on rank 1
    with pytest.raises(ValueError, match="must load its own checkpoint"):
        draw(elsewhere, randn(10), 1, rank=1, world=2)


# -- bit packing and table decoding ---------------------------------------------------------


def packed_by_hand(codes: list[int], bits: int) -> list[int]:
    """``pack`` computed independently: code i at bit ``bits * (i % per_byte)`` of byte
    ``i // per_byte``."""
    per_byte = 8 // bits
    out = [0] * -(-len(codes) // per_byte)
    for i, code in enumerate(codes):
        out[i // per_byte] |= code << (bits * (i % per_byte))
    return out


@settings(max_examples=80, deadline=None)
@given(
    bits=st.sampled_from([1, 2, 4, 8]),
    count=st.integers(1, 200),
    seed=st.integers(0, 2**31),
    dtype=st.sampled_from([torch.int64, torch.uint8, torch.int32]),
    offset=st.integers(0, 9),
)
def test_pack_unpack_and_decode_agree_with_a_byte_by_byte_reference(
    bits: int, count: int, seed: int, dtype: torch.dtype, offset: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (count,), generator=generator)
    # codes anywhere in a buffer: at any byte offset, not a multiple of 8 long
    buffer = torch.zeros(offset + count, dtype=dtype)
    buffer[offset:] = codes
    packed = pack(buffer[offset:], bits)
    assert packed.tolist() == packed_by_hand(codes.tolist(), bits)
    assert torch.equal(unpack(packed, bits, count), codes.to(torch.uint8))
    into = torch.full((packed_size(count, bits),), 255, dtype=torch.uint8)
    assert pack(codes, bits, out=into) is into and torch.equal(into, packed)
    values = torch.randn(2**bits, generator=generator)
    out = torch.empty(count)
    assert torch.equal(decode(packed, bits, values, out), values[codes])
    start = torch.randn(count, generator=generator)
    added = decode(packed, bits, values, start.clone(), add=True)
    assert torch.equal(added, start + values[codes])
    # a gathered payload can sit at an odd byte of its buffer
    shifted = torch.zeros(packed.numel() + 1, dtype=torch.uint8)
    shifted[1:] = packed
    assert torch.equal(decode(shifted[1:], bits, values, torch.empty(count)), values[codes])


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("count", [2 * CHUNK, 2 * CHUNK + 13])
def test_long_tensors_pack_and_decode_across_chunks(bits: int, count: int) -> None:
    # 2-bit codes of a million or more decode through the table of byte pairs.
    generator = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (count,), generator=generator, dtype=torch.uint8)
    mask_input = codes.bool() if bits == 1 else codes
    packed = pack(mask_input, bits)
    assert torch.equal(unpack(packed, bits, count), codes)
    start = count - 4096 - count % 8  # the last codes, from a byte boundary on
    assert packed[start * bits // 8 :].tolist() == packed_by_hand(codes[start:].tolist(), bits)
    values = torch.randn(2**bits, generator=generator)
    out = torch.empty(count)
    assert torch.equal(decode(packed, bits, values, out), values[codes.long()])
    out.fill_(1.0)
    assert torch.equal(decode(packed, bits, values, out, add=True), 1.0 + values[codes.long()])


def test_the_chunk_size_does_not_change_a_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    # on a GPU the loops take a whole tensor in one piece (bits.chunk_for); on the CPU in
    # cache-sized chunks: the codes, scales and decoded values must be the same either way
    generator = torch.Generator().manual_seed(11)
    flat = torch.randn(4099, generator=generator)
    matrix = torch.randn(48, 70, generator=generator)
    values = torch.randn(4, generator=generator)

    def everything() -> list[Tensor]:
        packed, scales = onebit_encode(flat)
        row_packed, row_scales = onebit_encode_rows(matrix)
        codes = pack(torch.randint(0, 4, (4099,), generator=torch.Generator().manual_seed(1)), 2)
        return [
            packed,
            scales,
            row_packed,
            row_scales,
            decode_signs(row_packed, row_scales, torch.empty(48, 70)),
            decode(codes, 2, values, torch.empty(4099)),
        ]

    monkeypatch.setattr(thinwire.compress.bits, "CHUNK", 64)  # many chunks, blocks of 8 rows
    in_pieces = everything()
    monkeypatch.setattr(thinwire.compress.bits, "CHUNK", 1 << 25)  # one piece, as on a GPU
    whole = everything()
    for a, b in zip(in_pieces, whole, strict=True):
        assert torch.equal(a, b)


def test_pack_refuses_an_out_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="out must be 2 uint8 bytes for 9 codes of 1 bits"):
        pack(torch.zeros(9, dtype=torch.uint8), 1, out=torch.empty(3, dtype=torch.uint8))


# -- output buffers reused between exchanges ------------------------------------------------


@pytest.mark.parametrize("cls", [OneBit, TernGrad], ids=lambda cls: cls.name)
def test_outputs_are_reused_only_once_nobody_holds_them(cls: type[Compressor]) -> None:
    compressor = cls()
    x, y = randn(64, 64, seed=1), randn(64, 64, seed=2)
    held = run_locally(compressor.exchange(x, Slot("w", 0, 1)))
    first_mean, first_local = held.mean.clone(), held.local.clone()
    reshaped = held.mean.reshape(-1)  # an alias held after the result itself is gone
    local_ptr = held.local.data_ptr()
    del held
    again = run_locally(compressor.exchange(y, Slot("w", 1, 1)))
    assert torch.equal(reshaped, first_mean.reshape(-1))  # a held mean never changes
    assert again.mean.data_ptr() != reshaped.data_ptr()
    assert again.local.data_ptr() == local_ptr  # nobody held the local: it was reused
    del again, reshaped
    kept = run_locally(compressor.exchange(x, Slot("w", 2, 1)))
    if cls is OneBit:  # deterministic: the same input decodes the same
        assert torch.equal(kept.mean, first_mean) and torch.equal(kept.local, first_local)
    other_key = run_locally(compressor.exchange(x, Slot("v", 2, 1)))
    assert other_key.mean.data_ptr() != kept.mean.data_ptr()  # buffers are per key
    state = compressor.state_dict()
    assert set(state) <= {"random"}  # buffers are scratch, not checkpoint state


def test_output_buffers_follow_shape_dtype_and_device() -> None:
    buffers = OutputBuffers()
    first = buffers.take("w", "mean", torch.empty(10))
    first_ptr = first.data_ptr()
    del first
    assert buffers.take("w", "mean", torch.empty(10)).data_ptr() == first_ptr
    assert buffers.take("w", "mean", torch.empty(12)).shape == (12,)
    assert buffers.take("w", "mean", torch.empty(12, dtype=torch.float64)).dtype == torch.float64
