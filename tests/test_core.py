"""Core pieces without processes: bit packing, the registry, error feedback, the CLI."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import thinwire
from thinwire.cli import main
from thinwire.compress import Slot, run_locally
from thinwire.compress.bits import pack, packed_size, unpack
from thinwire.compress.feedback import ResidualMemory
from thinwire.compress.finite import all_finite, not_finite_flag


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([1, 2, 4, 8]), count=st.integers(1, 300), seed=st.integers(0, 99))
def test_pack_unpack_round_trip(bits: int, count: int, seed: int) -> None:
    codes = torch.randint(0, 2**bits, (count,), generator=torch.Generator().manual_seed(seed))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_size(count, bits) == -(-count * bits // 8)
    assert torch.equal(unpack(packed, bits, count), codes.to(torch.uint8))


@settings(max_examples=80, deadline=None)
@given(
    size=st.integers(1, 2000),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    specials=st.lists(
        st.tuples(
            st.integers(0, 1999), st.sampled_from([float("nan"), float("inf"), -float("inf")])
        ),
        max_size=3,
    ),
    scale=st.sampled_from([1.0, 1e30, 3e38]),
    seed=st.integers(0, 99),
)
def test_all_finite_agrees_with_the_entrywise_check(
    size: int, dtype: torch.dtype, specials: list[tuple[int, float]], scale: float, seed: int
) -> None:
    values = torch.rand(size, generator=torch.Generator().manual_seed(seed)) * scale
    tensor = values.to(dtype)  # huge scales overflow to inf in the narrow dtypes, as they should
    for index, special in specials:
        tensor[index % size] = special
    assert all_finite(tensor) == bool(torch.isfinite(tensor).all())


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 500), min_size=1, max_size=5),
    dtypes=st.lists(
        st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), min_size=5, max_size=5
    ),
    special=st.one_of(
        st.none(),
        st.tuples(st.integers(0, 4), st.sampled_from([float("nan"), float("inf"), -float("inf")])),
    ),
    scale=st.sampled_from([1.0, 1e30, 3e38]),
)
def test_the_device_flag_agrees_with_the_entrywise_check(
    sizes: list[int], dtypes: list[torch.dtype], special: tuple | None, scale: float
) -> None:
    """One flag for several tensors (mixed dtypes), as the GPU's once-a-step verdict."""
    tensors = [
        (torch.rand(n, generator=torch.Generator().manual_seed(n)) * scale).to(dtype)
        for n, dtype in zip(sizes, dtypes, strict=False)
    ]
    if special is not None:
        tensors[special[0] % len(tensors)][-1] = special[1]
    expected = not all(bool(torch.isfinite(t).all()) for t in tensors)
    assert bool(not_finite_flag(tensors)) == expected


def test_all_finite_is_not_fooled_by_a_sum_that_overflows() -> None:
    big = torch.full((4,), 3e38)  # every entry finite, their float32 sum is inf
    assert torch.isinf(big.sum()) and all_finite(big)
    assert not all_finite(torch.tensor([float("inf"), -float("inf")]))  # sum NaN
    assert all_finite(torch.empty(0)) and all_finite(torch.arange(3))


def test_unsupported_bit_width_is_refused() -> None:
    with pytest.raises(ValueError, match="bits per code must be one of"):
        pack(torch.zeros(4, dtype=torch.uint8), 3)


def test_registry_lists_every_compressor_with_a_summary() -> None:
    listing = thinwire.compressors()
    assert {"none", "topk"} <= set(listing)
    assert all(isinstance(s, str) and len(s) > 10 for s in listing.values())


def test_topk_keeps_exactly_the_largest_entries() -> None:
    x = torch.randn(40, 50, generator=torch.Generator().manual_seed(0))
    sent: list[int] = []
    out = run_locally(thinwire.compressor("topk", density=0.1).exchange(x, Slot("w", 0, 1)), sent)
    kept = out.mean.reshape(-1) != 0
    assert int(kept.sum()) == 200
    threshold = x.abs().reshape(-1).kthvalue(2000 - 200 + 1).values
    assert bool((x.abs().reshape(-1)[kept] >= threshold).all())
    assert sent == [200 * 4 + 200 * 4]  # fp32 values + int32 indices


def test_residual_memory_conserves_mass_with_topk() -> None:
    gen = torch.Generator().manual_seed(1)
    compressor, memory = thinwire.compressor("topk", density=0.05), ResidualMemory()
    total_in = torch.zeros(30, 30)
    total_sent = torch.zeros(30, 30)
    for step in range(12):
        grad = torch.randn(30, 30, generator=gen)
        total_in += grad
        slot = Slot("w", step, 1)
        corrected = memory.compensate(grad, slot)
        result = run_locally(compressor.exchange(corrected, slot))
        memory.update(corrected, result, slot, compressed=True)
        total_sent += result.mean
    torch.testing.assert_close(total_sent + memory.residuals["w"], total_in, rtol=0, atol=1e-4)
    assert float(memory.residuals["w"].abs().sum()) > 0  # something really was held back


def _memory_step(memory, compressor, grad: torch.Tensor, step: int, commit: bool) -> None:
    slot = Slot("w", step, 1)
    corrected = memory.compensate(grad, slot)
    result = run_locally(compressor.exchange(corrected, slot))
    memory.update(corrected, result, slot, compressed=True)
    if commit:
        memory.commit()


@pytest.mark.parametrize("name", ["topk", "dgc"])
def test_a_rolled_back_step_leaves_the_memory_as_it_was(name: str) -> None:
    """The memory absorbed a refused step's gradient in place and kept it; now a step is
    only kept once committed (or once the key is compensated again), and a rollback puts
    back the state before it, bit for bit."""
    options = {"density": 0.05} if name == "topk" else {"density": 0.05, "masking": True}
    compressor = thinwire.compressor(name, **options)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(30, 30, generator=gen) for _ in range(6)]
    plain, undone, lazy = (compressor.make_memory() for _ in range(3))
    for step, grad in enumerate(grads):
        _memory_step(plain, compressor, grad, step, commit=True)
        if step in (2, 4):  # refused attempts: another gradient, rolled back after its update
            _memory_step(undone, compressor, grad * -7 + 1, step, commit=False)
            undone.rollback()
        _memory_step(undone, compressor, grad, step, commit=True)
        _memory_step(lazy, compressor, grad, step, commit=False)  # never commits
    for state in ("residuals",) if name == "topk" else ("velocities", "accumulators"):
        expected = getattr(plain, state)["w"]
        assert float(expected.abs().sum()) > 0
        assert torch.equal(getattr(undone, state)["w"], expected)
        assert torch.equal(getattr(lazy, state)["w"], expected)
    # a checkpoint holds the newest state, and a rollback after loading keeps it
    restored = compressor.make_memory()
    restored.load_state_dict(lazy.state_dict())
    restored.rollback()
    for key, tensors in restored.state_dict().items():
        for k, tensor in tensors.items():
            assert torch.equal(tensor, plain.state_dict()[key][k])


def test_cli_lists_compressors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compressors"]) == 0
    shown = capsys.readouterr().out
    for name in thinwire.compressors():
        assert name in shown


def test_step_statistics_are_strict_json_also_for_a_step_that_sent_nothing() -> None:
    """A step with no payload wrote compression_ratio NaN, which strict JSON refuses."""
    import json

    from thinwire.comm.engine import StepStats

    empty = StepStats(step=3)
    assert json.loads(json.dumps(empty.as_dict(), allow_nan=False))["compression_ratio"] is None
    sent = StepStats(step=4, dense_bytes=400, payload_bytes=100)
    assert sent.as_dict()["compression_ratio"] == 4.0
