"""Where thinwire's control tensors live, and NCCL-only process groups (no GPU needed).

With NCCL alone (``init_process_group("nccl")``) a group has no CPU backend: a CPU tensor
in a collective, or asking the group for its CPU backend, raises. ``bench/gpu_check.py``
runs the real thing on a GPU; these tests pin the two decisions it relies on.
"""

from __future__ import annotations

import datetime
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from thinwire.comm.collectives import control_device, group_timeout
from thinwire.compress.finite import FiniteChecks


@pytest.mark.parametrize(
    ("backend", "cuda", "expected"),
    [
        ("nccl", True, torch.device("cuda", 3)),
        ("gloo", True, torch.device("cpu")),
        ("cpu:gloo,cuda:nccl", True, torch.device("cpu")),
        ("mpi", True, torch.device("cpu")),
        ("nccl", False, torch.device("cpu")),
    ],
)
def test_control_tensors_go_where_the_backend_carries_them(
    monkeypatch: pytest.MonkeyPatch, backend: str, cuda: bool, expected: torch.device
) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert control_device() == expected


class NcclOnlyGroup:
    """A process group as NCCL alone presents it: no CPU backend, a CUDA one with options."""

    def _get_backend(self, device: torch.device) -> SimpleNamespace:
        if device.type != "cuda":
            raise RuntimeError(f"No backend type associated with device type {device.type}")
        return SimpleNamespace(options=SimpleNamespace(_timeout=datetime.timedelta(seconds=42)))


def test_the_timeout_of_an_nccl_only_group_is_read_from_its_cuda_backend() -> None:
    # thinwire.register failed here on NCCL before: it asked for the CPU backend unguarded
    assert group_timeout(NcclOnlyGroup()) == datetime.timedelta(seconds=42)  # type: ignore[arg-type]


def test_a_group_without_any_readable_timeout_gives_none() -> None:
    assert group_timeout(SimpleNamespace()) is None  # type: ignore[arg-type]


def test_finite_checks_name_the_tensors_with_nan_or_inf_in_order() -> None:
    checks = FiniteChecks()
    tensors = [
        torch.ones(3),
        torch.tensor([1.0, math.nan]),
        torch.empty(0),
        torch.tensor([3.0e38, 3.0e38]),  # finite, though its fp32 sum overflows
        torch.arange(4),  # integers: nothing to check
        torch.tensor([-math.inf], dtype=torch.bfloat16),
    ]
    for i, tensor in enumerate(tensors):
        checks.add(i, tensor)
    tensors[0].fill_(math.nan)  # written after its check: the check saw it finite
    assert checks.failed() == [1, 5]
