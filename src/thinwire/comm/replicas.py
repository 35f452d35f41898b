"""Make every rank's copy of the model rank ``root``'s, sending only what differs.

Front ends start by copying rank 0's parameters to every rank (replicas that start apart
never meet again). Replicas built from the same seed, the usual case, already agree, and
on the links thinwire is for, the copy is what costs: rank 0 alone sends the model to every
other rank, which for the image task's 11 MB model takes about 4.5 minutes at 1 Mbit/s.
So the ranks first compare a 64-bit digest of each tensor's bytes (one all-gather of 8
bytes a tensor) and broadcast only the tensors whose bytes differ on some rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from thinwire.comm.collectives import run_collective


def tensor_digest(tensor: Tensor) -> int:
    """A 64-bit signed digest of ``tensor``'s bytes (its values and dtype, not its strides)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    hashed = hashlib.blake2b(data, digest_size=8, person=str(tensor.dtype).encode()[:16])
    return int.from_bytes(hashed.digest(), "little", signed=True)


def broadcast_where_different(
    named: Sequence[tuple[str, Tensor]], root: int, group: dist.ProcessGroup | None = None
) -> list[str]:
    """Copy rank ``root``'s ``(name, tensor)`` pairs into every rank's where any rank's
    bytes differ; the names copied (the same list on every rank). Collective: every rank
    of ``group`` calls it with tensors of the same names, shapes and dtypes."""
    if not named:
        return []
    device = named[0][1].device
    mine = torch.tensor([tensor_digest(t) for _, t in named], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    run_collective("the comparison of the replicas' tensors", dist.all_gather, everyone, mine,
                   group=group)  # fmt: skip
    stacked = torch.stack(everyone)
    differs = (stacked != stacked[:1]).any(dim=0).tolist()
    sent = []
    with torch.no_grad():
        for (name, tensor), different in zip(named, differs, strict=True):
            if different:
                run_collective(
                    f"the broadcast of {name!r}", dist.broadcast, tensor, src=root, group=group
                )
                sent.append(name)
    return sent
