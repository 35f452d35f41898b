"""Host synchronisations of thinwire's hook in a steady-state step on a GPU (NCCL, one
rank). Skipped without a CUDA device; ``bench/gpu_syncs.py`` prints the same counts."""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import thinwire
from thinwire.compress import Slot, run_locally
from thinwire.compress.dgc import DGC
from thinwire.launch import free_port

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)"),
    pytest.mark.timeout(300),
]

OPTIONS = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "powersgd": {"rank": 2},
    "dgc": {"density": 0.01},
    "topk": {"density": 0.01},
    "onebit": {},
    "signsgd": {},
    "terngrad": {},
    "qsgd": {},
}


@pytest.fixture(scope="module")
def nccl() -> Iterator[None]:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def syncs_in_a_step(
    method: str, layers: int, width: int = 64, bucket_mb: float = 100, fused: bool = False
) -> int:
    """thinwire's synchronisations in the fourth step of ``layers`` linear layers of
    ``width`` (DDP buckets of ``bucket_mb``: one by default; ``fused``: a fused SGD that
    thinwire is given, so that it refuses a step on the device)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).cuda()
    ddp = DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=bucket_mb)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, fused=fused or None)
    given = {"optimizer": optimizer} if fused else {}
    thinwire.register(ddp, method, **given, **OPTIONS[method])
    return syncs_in_fourth_step(ddp, optimizer, width)


def syncs_in_fourth_step(model: nn.Module, optimizer: Any, width: int) -> int:
    """Three steps of ``model`` and ``optimizer`` on one batch, then thinwire's host
    waits in the fourth (PyTorch's own lines sometimes add one of theirs: not counted)."""
    inputs = torch.randn(8, width, device="cuda")

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        model(inputs).square().mean().backward()
        optimizer.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) and "thinwire" in w.filename for w in caught)


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_host_waits_do_not_grow_with_the_tensors(nccl: None, method: str) -> None:
    """8 or 32 layers in one bucket: the same number of host waits (none per tensor)."""
    assert syncs_in_a_step(method, 8) == syncs_in_a_step(method, 32)


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_one_host_wait_per_step_whatever_the_buckets(nccl: None, method: str) -> None:
    """Eight buckets: the step's finiteness verdict is read once, at its last bucket."""
    assert syncs_in_a_step(method, 16, width=128, bucket_mb=0.1) <= 1


def test_powersgd_revives_dead_rows_on_the_device() -> None:
    from thinwire.compress.powersgd import PowerSGD

    powersgd = PowerSGD(rank=2)
    zeros = torch.zeros(3, 40, 30, device="cuda")  # all-zero gradients: Q^T would die
    slots = [Slot(key, 0, 1) for key in "abc"]
    run_locally(powersgd.exchange_stacked(zeros, slots))
    for key in "abc":
        assert bool((powersgd.warm[key].abs().amax(dim=1) > 0).all())
    run_locally(powersgd.exchange(zeros[0], Slot("d", 0, 1)))
    assert bool((powersgd.warm["d"].abs().amax(dim=1) > 0).all())


def test_dgc_waits_no_more_with_more_large_tensors(nccl: None) -> None:
    """Weights of 512 x 512 (larger than the segments' limit) go alone, through DGC's
    threshold selection: none of them adds a host wait."""
    assert syncs_in_a_step("dgc", 2, width=512) == syncs_in_a_step("dgc", 6, width=512)


def test_dgc_threshold_selection_never_waits() -> None:
    flat = torch.randn(4_000_000, device="cuda")
    dgc = DGC(density=0.001, warmup_steps=0, selection="threshold")
    dgc.pick(flat, 4000, Slot("w", 0, 1))  # first call: buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        indices, values = dgc.pick(flat, 4000, Slot("w", 1, 1))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert indices.shape == (4000,) and 3000 <= int((values != 0).sum()) <= 4000


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_no_host_wait_in_a_steady_state_step(nccl: None, method: str) -> None:
    """With a fused optimizer the verdict stays on the device: no wait at all, in one
    bucket or in eight."""
    assert syncs_in_a_step(method, 8, fused=True) == 0
    assert syncs_in_a_step(method, 16, width=128, bucket_mb=0.1, fused=True) == 0


def test_no_host_wait_through_the_optimizer_wrapper(nccl: None) -> None:
    """``DistributedOptimizer(refusal="device")`` with a fused SGD: no wait either."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]).cuda()
    inner = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
    optimizer = thinwire.DistributedOptimizer(inner, model, "topk", density=0.01, refusal="device")
    assert syncs_in_fourth_step(model, optimizer, 64) == 0


def train_with_a_nan(method: str, steps: int) -> list[torch.Tensor]:
    """``steps`` steps on the GPU with a fused SGD, the fourth one's batch (if taken)
    holding a NaN. Returns the weights and thinwire's memory after them."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).cuda()
    ddp = DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.02)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, fused=True)
    engine = thinwire.register(ddp, method, optimizer=optimizer, **OPTIONS[method])
    data = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            x = torch.randn(8, 64, generator=data).cuda()
            if step == 3:
                x[0, 0] = float("nan")
            optimizer.zero_grad()
            ddp(x).square().mean().backward()  # step 3: no error, no wait
            optimizer.step()
        torch.cuda.synchronize()
        engine.device_refusal.poll()
    warned = [w for w in caught if "step 3 was skipped on every rank" in str(w.message)]
    assert len(warned) == len(engine.device_refusal.refused_steps) == (steps > 3)
    memory = engine.memory.state_dict()
    return [p.detach().clone() for p in model.parameters()] + [
        t for part in memory.values() for t in part.values()
    ]


@pytest.mark.parametrize("method", ["none", "dgc", "topk", "powersgd", "onebit"])
def test_a_step_refused_on_the_gpu_leaves_no_trace(nccl: None, method: str) -> None:
    """After a fourth step refused on the device, the weights and the memory are the
    third's, to the bit."""
    refused, three = train_with_a_nan(method, 4), train_with_a_nan(method, 3)
    assert all(torch.equal(a, b) for a, b in zip(refused, three, strict=True))
