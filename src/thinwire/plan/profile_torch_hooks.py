"""PyTorch's own communication hooks, profiled by calling them.

``fp16_compress_hook`` and ``powerSGD_hook`` are Python functions of a process group (or
a state holding one) and a ``GradBucket``. The profiler hands them a bucket of the
profiler's (:class:`HookBucket`: the methods the hooks call) and a process group that
answers in this process and records what each collective would carry
(:class:`RecordingGroup`, a Python ``ProcessGroup``, the extension point
``torch.distributed`` offers for backends written in Python): a sum is ``world_size``
copies of this rank's payload, so the hook's own arithmetic (division by the world size,
PowerSGD's orthogonalisation, error feedback and warm start) runs as it does in training.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from thinwire.plan.network import ALLREDUCE, Collective
from thinwire.plan.profile_buckets import Bucket


class _Done(dist.Work):
    """A finished collective: its future holds the tensors it reduced."""

    def __init__(self, tensors: list[Tensor]) -> None:
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(tensors)

    def wait(self, timeout: Any = None) -> bool:
        """Nothing to wait for."""
        return True

    def get_future(self) -> torch.futures.Future:
        """The reduced tensors."""
        return self._future


class RecordingGroup(dist.ProcessGroup):
    """A process group of ``world`` ranks in which every rank sent what this one did:
    an all-reduce multiplies by ``world``; each records its bytes in :attr:`sent`."""

    def __init__(self, world: int) -> None:
        super().__init__(0, world)
        #: the bytes of every all-reduce since it was last emptied
        self.sent: list[int] = []

    def allreduce(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """Record and 'sum' ``tensors`` in place."""
        for tensor in tensors:
            self.sent.append(tensor.numel() * tensor.element_size())
            tensor.mul_(self.size())
        return _Done(tensors)

    def getBackendName(self) -> str:  # noqa: N802  (the ProcessGroup interface)
        """The backend's name, as ProcessGroup reports it."""
        return "thinwire-recording"


class HookBucket:
    """What a communication hook asks of DDP's ``GradBucket``, over a profiler bucket."""

    def __init__(self, bucket: Bucket, last: bool) -> None:
        self._bucket, self._last = bucket, last
        self._buffer = bucket.buffer

    def buffer(self) -> Tensor:
        """The flat gradient buffer."""
        return self._buffer

    def set_buffer(self, buffer: Tensor) -> None:
        """Replace the flat buffer (as PowerSGD does with its decompressed result)."""
        self._buffer = buffer

    def index(self) -> int:
        """The bucket's position in the step."""
        return self._bucket.index

    def is_last(self) -> bool:
        """Whether it is the step's last bucket (PowerSGD counts steps on it)."""
        return self._last

    def parameters(self) -> list[Tensor]:
        """The bucket's parameters."""
        return self._bucket.params

    def gradients(self) -> list[Tensor]:
        """Views of the buffer, one per parameter."""
        return self._bucket.views


class TorchHook:
    """An exchanger that calls one of PyTorch's hooks on each bucket; ``warmup_runs``:
    steps to run before measuring (PowerSGD all-reduces densely until
    ``start_powerSGD_iter``)."""

    def __init__(
        self, hook: Callable[[Any, Any], torch.futures.Future], state: Any, group: RecordingGroup,
        warmup_runs: int = 1,
    ) -> None:  # fmt: skip
        self.hook, self.state, self.group = hook, state, group
        self.warmup_runs = warmup_runs

    @classmethod
    def fp16(cls, world: int) -> TorchHook:
        """``fp16_compress_hook``, whose state is the process group."""
        group = RecordingGroup(world)
        return cls(default_hooks.fp16_compress_hook, group, group)

    @classmethod
    def powersgd(cls, options: Mapping[str, Any], world: int) -> TorchHook:
        """``powerSGD_hook`` with a ``PowerSGDState`` of ``options``, measured past its
        dense start."""
        group = RecordingGroup(world)
        state = powerSGD_hook.PowerSGDState(process_group=group, **options)
        return cls(powerSGD_hook.powerSGD_hook, state, group, state.start_powerSGD_iter + 1)

    def __call__(self, bucket: Bucket, run: int, last: bool) -> list[Collective]:
        """Run the hook on ``bucket``; the averaged gradients land in it."""
        self.group.sent = []
        averaged = self.hook(self.state, HookBucket(bucket, last)).wait()
        if averaged.data_ptr() != bucket.buffer.data_ptr():
            bucket.buffer.copy_(averaged)
        return [Collective(ALLREDUCE, nbytes) for nbytes in self.group.sent if nbytes]
