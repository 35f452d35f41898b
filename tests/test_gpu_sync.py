"""Host synchronisations of thinwire's hook in a steady-state step on a GPU (NCCL, one
rank). Skipped without a CUDA device; ``bench/gpu_syncs.py`` prints the same counts."""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import thinwire
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


def syncs_in_a_step(method: str, layers: int) -> int:
    """thinwire's synchronisations in the fourth step of ``layers`` linear layers (one
    DDP bucket)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)]).cuda()
    ddp = DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=100)
    thinwire.register(ddp, method, **OPTIONS[method])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    inputs = torch.randn(8, 64, device="cuda")

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        ddp(inputs).square().mean().backward()
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
    # the waits thinwire's own lines ask for (PyTorch sometimes adds one of its own)
    return sum("synchroniz" in str(w.message) and "thinwire" in w.filename for w in caught)


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_host_waits_do_not_grow_with_the_tensors(nccl: None, method: str) -> None:
    """8 or 32 layers in one bucket: the same number of host waits (none per tensor)."""
    assert syncs_in_a_step(method, 8) == syncs_in_a_step(method, 32)


@pytest.mark.xfail(
    strict=True,
    reason="the finiteness verdict of a bucket is still read on the host (a refused step "
    "must leave no trace before DDP hands the gradients to the optimizer)",
)
def test_no_host_wait_in_a_steady_state_step(nccl: None) -> None:
    assert syncs_in_a_step("none", 8) == 0
