"""PowerSGD over a whole bucket at once (``layout="bucket"``, a GPU's default): the
Householder orthonormalisation is the QR's, the exchange computes what the per-tensor one
computes, dead rows revive, warm starts and checkpoints carry across layouts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import thinwire
from thinwire.comm.runs import group_runs
from thinwire.compress.base import Slot, run_locally
from thinwire.compress.powersgd import PowerSGD, orthonormal_rows
from thinwire.compress.powersgd_bucket import BucketLayout, householder_rows
from thinwire.compress.powersgd_oneround import OneRoundPowerSGD

pytestmark = pytest.mark.timeout(120)

#: same shapes apart (first, second, fourth), a rank-limited one (3 rows), a linear layer
SHAPES = [
    torch.Size([16, 8, 3, 3]),
    torch.Size([16, 8, 3, 3]),
    torch.Size([32, 16]),
    torch.Size([16, 8, 3, 3]),
    torch.Size([3, 40]),
]


@pytest.mark.parametrize("shape", [(5, 2, 10), (3, 1, 7), (2, 4, 50), (1, 3, 300)])
def test_householder_rows_are_the_qrs(shape: tuple[int, int, int]) -> None:
    rows = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    expected = orthonormal_rows(rows)
    got = householder_rows(rows.clone())
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("scale", [1e-25, 1e25])
def test_householder_rows_of_tiny_and_huge_values_are_the_qrs(scale: float) -> None:
    """A deep layer's gradients (and so its P) can be 1e-25: their squares underflow a
    plain norm (and 1e25's overflow it); the result must not change with the scale."""
    rows = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(8)) * scale
    got = householder_rows(rows.clone())
    torch.testing.assert_close(got, orthonormal_rows(rows), rtol=0, atol=2e-6)


def test_householder_rows_complete_zero_and_dependent_rows() -> None:
    rows = torch.randn(4, 3, 20, generator=torch.Generator().manual_seed(2))
    rows[0, 1] = 0.0  # a zero row
    rows[1, 2] = 3 * rows[1, 0]  # a dependent one
    rows[2] = 0.0  # nothing at all
    rows[3, 1] = rows[3, 0] + 1e-7 * rows[3, 2]  # nearly dependent
    q = householder_rows(rows.clone())
    assert torch.isfinite(q).all()
    torch.testing.assert_close(q @ q.mT, torch.eye(3).expand(4, 3, 3), rtol=0, atol=1e-6)
    # rows that were independent still span what they spanned: the first row's direction
    first = rows[0, 0] / rows[0, 0].norm()
    assert abs(float(q[0, 0] @ first)) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="rows no more than columns"):
        householder_rows(torch.zeros(1, 3, 2))


def test_the_layout_stacks_adjacent_same_shapes_and_pads_the_factors() -> None:
    layout = BucketLayout(SHAPES, rank=4)
    assert [(s.first, s.count, s.n, s.m, s.r) for s in layout.stacks] == [
        (0, 2, 16, 72, 4),
        (2, 1, 32, 16, 4),
        (3, 1, 16, 72, 4),
        (4, 1, 3, 40, 3),
    ]
    assert layout.padded_shape == (5, 4, 32)
    assert layout.numel == sum(math.prod(s) for s in SHAPES)
    places = layout.places(torch.device("cpu"))
    assert places.numel() == layout.p_numel and places.unique().numel() == places.numel()


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_the_bucket_exchange_is_the_per_tensor_one_over_steps(rank: int) -> None:
    """Means, local approximations and the next warm starts, to fp32 rounding."""
    generator = torch.Generator().manual_seed(3)
    bucket, alone = PowerSGD(rank=rank, layout="bucket"), PowerSGD(rank=rank)
    keys = [f"t{i}" for i in range(len(SHAPES))]
    for step in range(3):
        tensors = [torch.randn(shape, generator=generator) for shape in SHAPES]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        slots = [Slot(key, step, world_size=1) for key in keys]
        together = run_locally(bucket.exchange_segmented(flat, SHAPES, slots))
        singles = [run_locally(alone.exchange(t, s)) for t, s in zip(tensors, slots, strict=True)]
        mean = torch.cat([r.mean.reshape(-1) for r in singles])
        local = torch.cat([r.local.reshape(-1) for r in singles])
        torch.testing.assert_close(together.mean, mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together.local, local, rtol=1e-5, atol=1e-5)
        for key in keys:
            assert_same_rows(bucket.warm[key], alone.warm[key])


def assert_same_rows(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Rows equal to rounding up to their signs (a row with nothing below its diagonal
    is reflected by ``householder_rows`` and left by LAPACK; PowerSGD's products do not
    see the sign)."""
    signs = torch.sign((got * expected).sum(dim=-1, keepdim=True))
    torch.testing.assert_close(got * signs, expected, rtol=1e-5, atol=1e-5)


def test_a_zero_tensors_warm_start_revives_from_its_spare_rows() -> None:
    compressor = PowerSGD(rank=2, layout="bucket")
    tensors = [torch.randn(shape, generator=torch.Generator().manual_seed(4)) for shape in SHAPES]
    tensors[2] = torch.zeros(SHAPES[2])
    flat = torch.cat([t.reshape(-1) for t in tensors])
    slots = [Slot(f"t{i}", 0, world_size=1) for i in range(len(SHAPES))]
    outcome = run_locally(compressor.exchange_segmented(flat, SHAPES, slots))
    revived = compressor.warm["t2"]
    assert torch.isfinite(revived).all() and (revived.abs().amax(dim=1) > 0).all()
    assert torch.isfinite(outcome.mean).all()
    # the others' warm starts are their averaged Q^T, not spare rows
    reference = PowerSGD(rank=2)
    run_locally(reference.exchange(tensors[0], slots[0]))
    torch.testing.assert_close(compressor.warm["t0"], reference.warm["t0"], rtol=1e-5, atol=1e-5)


def test_the_warm_start_is_reused_and_a_checkpoint_carries_across_layouts() -> None:
    generator = torch.Generator().manual_seed(6)
    steps = [
        torch.cat([torch.randn(shape, generator=generator).reshape(-1) for shape in SHAPES])
        for _ in range(3)
    ]
    slots = [[Slot(f"t{i}", step, world_size=1) for i in range(len(SHAPES))] for step in range(3)]
    compressor = PowerSGD(rank=2, layout="bucket")
    for step in range(2):
        run_locally(compressor.exchange_segmented(steps[step], SHAPES, slots[step]))
    state = next(iter(compressor._buckets.values()))
    kept = state.warm[0]
    assert compressor._bucket_warm_start(state, SHAPES, slots[2], steps[2]) is kept  # no copy
    saved = compressor.state_dict()
    continued = run_locally(compressor.exchange_segmented(steps[2], SHAPES, slots[2]))
    for layout in ("bucket", "stacks"):
        restored = PowerSGD(rank=2, layout=layout)
        restored.load_state_dict(saved)
        if layout == "bucket":
            resumed = run_locally(restored.exchange_segmented(steps[2], SHAPES, slots[2]))
            mean = resumed.mean
        else:
            parts = steps[2].split([math.prod(s) for s in SHAPES])
            results = [
                run_locally(restored.exchange(p.view(s), slot))
                for p, s, slot in zip(parts, SHAPES, slots[2], strict=True)
            ]
            mean = torch.cat([r.mean.reshape(-1) for r in results])
        torch.testing.assert_close(mean, continued.mean, rtol=1e-5, atol=1e-5)


def test_layouts_are_checked_and_chosen_by_device() -> None:
    with pytest.raises(ValueError, match="layout must be one of 'auto', 'stacks', 'bucket'"):
        PowerSGD(layout="rows")
    assert not PowerSGD().bucket_as_segments(torch.device("cpu"))
    assert PowerSGD().bucket_as_segments(torch.device("cuda"))
    assert PowerSGD(layout="bucket").bucket_as_segments(torch.device("cpu"))
    assert "layout" not in repr(PowerSGD(layout="bucket"))  # a checkpoint's owner is the same
    kinds = [(torch.Size([4, 4]), (torch.float32, torch.device("cpu")))] * 3 + [
        (torch.Size([4]), (torch.float32, torch.device("cpu")))
    ]
    compressed = [True, True, True, False]
    groups = group_runs(kinds, compressed, PowerSGD(layout="bucket"))
    assert [(g.members, g.how) for g in groups] == [([3], "flat"), ([0, 1, 2], "segments")]
    groups = group_runs(kinds, compressed, PowerSGD())
    assert [(g.members, g.how) for g in groups] == [([3], "flat"), ([0, 1, 2], "stacked")]


def test_the_bucket_run_puts_same_shapes_together() -> None:
    """One batched product per shape: a bucket's same-shaped matrices side by side, each
    shape where its first matrix was (a 4-d kernel counts as its rows x the rest)."""
    cpu = (torch.float32, torch.device("cpu"))
    shapes = [(8, 4, 3, 3), (16, 8), (8, 36), (4,), (16, 8), (3, 5)]
    kinds = [(torch.Size(shape), cpu) for shape in shapes]
    compressed = [True, True, True, False, True, True]
    groups = group_runs(kinds, compressed, PowerSGD(layout="bucket"))
    assert [(g.members, g.how) for g in groups] == [([3], "flat"), ([0, 2, 1, 4, 5], "segments")]
    layout = BucketLayout([torch.Size(shapes[i]) for i in (0, 2, 1, 4, 5)], rank=2)
    assert [(s.count, s.n, s.m) for s in layout.stacks] == [(2, 8, 36), (2, 16, 8), (1, 3, 5)]


def test_one_round_powersgd_goes_one_tensor_at_a_time() -> None:
    """Its bases are per tensor: PowerSGD's stacked exchange (two rounds) is not its own."""
    kinds = [(torch.Size([4, 4]), (torch.float32, torch.device("cuda")))] * 2
    groups = group_runs(kinds, [True, True], OneRoundPowerSGD(rank=1))
    assert [(g.members, g.how) for g in groups] == [([0], "alone"), ([1], "alone")]


def _model(all_compressed: bool) -> nn.Module:
    """Biases and a nonlinearity, or (``all_compressed``) bias-free layers of interleaved
    shapes: then the bucket's one run holds all its tensors, not in the bucket's order."""
    if all_compressed:
        shapes = [(12, 12), (12, 20), (20, 12), (12, 12)]
        return nn.Sequential(*[nn.Linear(a, b, bias=False) for a, b in shapes])
    return nn.Sequential(
        nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Linear(12, 20), nn.Linear(20, 3)
    )


def _train(rank: int, layout: str, all_compressed: bool, hook: bool) -> list[np.ndarray]:
    """Four steps through ``DistributedOptimizer``, or (``hook``) DDP with thinwire's hook,
    whose bucket comes back whole when one run held it (``runs.whole_bucket``)."""
    torch.manual_seed(0)
    model = _model(all_compressed)
    compressor = PowerSGD(rank=2, layout=layout, min_compression=0 if all_compressed else 2.0)
    if hook:
        model = torch.nn.parallel.DistributedDataParallel(model)
        thinwire.register(model, compressor)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = thinwire.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, compressor
        )
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 12, generator=generator)).square().mean().backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def train_both_layouts(rank: int, world: int, all_compressed: bool, hook: bool = False) -> float:
    """Largest relative difference between the weights trained in either layout."""
    bucket = _train(rank, "bucket", all_compressed, hook)
    stacks = _train(rank, "stacks", all_compressed, hook)
    pairs = zip(bucket, stacks, strict=True)
    return max(float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12)) for a, b in pairs)


@pytest.mark.multiprocess
def test_two_ranks_train_the_same_in_either_layout(pool2) -> None:
    assert max(pool2.run(train_both_layouts, False)) < 1e-4


@pytest.mark.multiprocess
@pytest.mark.parametrize("hook", [False, True], ids=["optimizer", "ddp-hook"])
def test_a_bucket_run_out_of_the_buckets_order_trains_the_same(pool2, hook: bool) -> None:
    assert max(pool2.run(train_both_layouts, True, hook)) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_bucket_exchange_waits_for_nothing() -> None:
    """The default layout there; no host synchronisation once its buffers exist, and the
    per-tensor exchange's results."""
    compressor = PowerSGD(rank=2)
    reference = PowerSGD(rank=2)
    generator = torch.Generator().manual_seed(7)
    keys = [f"t{i}" for i in range(len(SHAPES))]
    for step in range(2):
        tensors = [torch.randn(shape, generator=generator) for shape in SHAPES]
        flat = torch.cat([t.reshape(-1) for t in tensors]).cuda()
        slots = [Slot(key, step, world_size=1) for key in keys]
        assert compressor.bucket_as_segments(flat.device)
        torch.cuda.synchronize()
        if step == 1:
            torch.cuda.set_sync_debug_mode("error")
        try:
            outcome = run_locally(compressor.exchange_segmented(flat, SHAPES, slots))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        singles = [run_locally(reference.exchange(t, s)) for t, s in zip(tensors, slots)]
        mean = torch.cat([r.mean.reshape(-1) for r in singles])
        torch.testing.assert_close(outcome.mean.cpu(), mean, rtol=1e-4, atol=1e-4)


def train_deep(rank: int, world: int) -> bool:
    """32 linear layers: the deep ones' gradients are tiny (their P factors 1e-20 and
    less), which a plain norm in the orthonormalisation turned into inf and then NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(32)])
    opt = thinwire.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model, PowerSGD(rank=2, layout="bucket")
    )
    generator = torch.Generator().manual_seed(rank)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 64, generator=generator)).square().mean().backward()
        opt.step()  # raises NonFiniteGradientError if a step went non-finite
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.multiprocess
def test_a_deep_model_with_tiny_gradients_stays_finite(pool2) -> None:
    assert all(pool2.run(train_deep))
