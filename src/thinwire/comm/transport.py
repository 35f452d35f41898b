"""What went wrong on the wire, and whole byte strings of any length from every rank.

:func:`is_transport_failure` tells a failed or timed-out collective (a dead, diverged or
stalled peer) from a bug in the caller's code; :func:`gather_bytes` collects every rank's
bytes (pickled state, for checkpoints) in rank order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from thinwire.comm.collectives import control_device, run_collective
from thinwire.errors import ThinwireError

#: what the backends' messages say when a peer died or stalled (some of their errors, such
#: as gloo's on a point-to-point send, are plain RuntimeErrors)
_TRANSPORT_SIGNS = ("gloo", "nccl", "timed out", "connection closed", "connection reset")


def is_transport_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed or timed-out collective or send, not a bug in the
    caller's code (thinwire's own errors are not: they already say what happened). The
    errors it was raised from count too (PyTorch's pipeline wraps a stage's failure)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ThinwireError):
            return False
        if isinstance(seen, dist.DistError):
            return True
        text = str(seen).lower()
        if isinstance(seen, RuntimeError) and any(sign in text for sign in _TRANSPORT_SIGNS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def gather_bytes(data: bytes, group: dist.ProcessGroup | None, what: str) -> list[bytes]:
    """Every rank's ``data`` (of any length), in rank order. Collective: two all-gathers,
    of the lengths and of the bytes padded to the longest (gloo gathers equal sizes only)."""
    device = control_device(group)
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    run_collective(what, dist.all_gather, lengths, length, group=group)
    longest = max(int(n) for n in lengths)
    own = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        own[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty_like(own) for _ in range(world)]
    run_collective(what, dist.all_gather, parts, own, group=group)
    return [p[: int(n)].cpu().numpy().tobytes() for p, n in zip(parts, lengths, strict=True)]
