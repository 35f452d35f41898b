"""What every quantizer shares: its contract, private random streams, bit packing, buffers."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import thinwire
import thinwire.compress.bits
from compressor_cases import SLOT, drive, randn
from thinwire.compress import Op, Slot, run_locally
from thinwire.compress.base import Compressor
from thinwire.compress.bf16 import BF16
from thinwire.compress.bits import CHUNK, OutputBuffers, decode, pack, packed_size, unpack
from thinwire.compress.feedback import NoMemory, ResidualMemory
from thinwire.compress.fp16 import FP16
from thinwire.compress.onebit import OneBit, decode_signs
from thinwire.compress.onebit import encode as onebit_encode
from thinwire.compress.onebit import encode_rows as onebit_encode_rows
from thinwire.compress.qsgd import QSGD
from thinwire.compress.signsgd import SignSGD
from thinwire.compress.stochastic import RankStream
from thinwire.compress.terngrad import TernGrad

ALL = [FP16, BF16, OneBit, SignSGD, TernGrad, QSGD]
STOCHASTIC = [TernGrad, QSGD]


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
