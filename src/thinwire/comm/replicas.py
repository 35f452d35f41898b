"""Make every rank's copy of the model rank ``root``'s, sending only what differs.

Front ends start by copying rank 0's parameters to every rank (replicas that start apart
never meet again). Replicas built from the same seed, the usual case, already agree, and
on the links thinwire is for, the copy is what costs: rank 0 alone sends the model to every
other rank (the image task's 11 MB model three times through one 1 Mbit/s link: about 4.5
minutes by the link's rate). So the ranks first compare a digest of each tensor's bytes
(:func:`thinwire.comm.agreement.ranks_differing`: one all-gather of 8 bytes a tensor) and
broadcast only the tensors whose bytes differ on some rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from thinwire.comm.agreement import parameter_layout, ranks_differing
from thinwire.comm.collectives import run_collective
from thinwire.errors import RankMismatchError


def tensor_digest(tensor: Tensor) -> str:
    """A digest of ``tensor``'s bytes (its values and dtype, not its strides)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16, person=str(tensor.dtype).encode()[:16]).hexdigest()


def broadcast_where_different(
    named: Sequence[tuple[str, Tensor]], root: int, group: dist.ProcessGroup | None = None
) -> list[str]:
    """Copy rank ``root``'s ``(name, tensor)`` pairs into every rank's where any rank's
    bytes differ; the names copied (the same list on every rank: where any two ranks
    differ, every rank sees one that differs from it). Collective: every rank of
    ``group`` calls it with tensors of the same names, shapes and dtypes."""
    if not named:
        return []
    differing = ranks_differing([tensor_digest(t) for _, t in named], group)
    sent = []
    with torch.no_grad():
        for (name, tensor), ranks in zip(named, differing, strict=True):
            if ranks:
                run_collective(
                    f"the broadcast of {name!r}", dist.broadcast, tensor, src=root, group=group
                )
                sent.append(name)
    return sent


def copy_module_states(module: nn.Module, group: dist.ProcessGroup | None = None) -> list[str]:
    """What ``DistributedDataParallel`` does when it is built (check that every rank's
    parameters and buffers have the same names, shapes and dtypes; make them rank 0's;
    those DDP is told to ignore, such as sharded embedding tables, left alone),
    sending only the tensors that differ; the names copied. Build DDP with
    ``init_sync=False`` afterwards: its own copy sends the whole model from rank 0 through
    rank 0's link, whatever the ranks hold (the image task's 11 MB, three times, through a
    100 kbit/s link: about 45 minutes by the link's rate). Raises
    :class:`RankMismatchError` on every rank when the layouts differ. Collective over
    ``group``."""
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))  # DDP's own
    named = [
        (name, tensor)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
        if name not in ignored
    ]
    (differing,) = ranks_differing([parameter_layout(named)], group)
    if differing:
        raise RankMismatchError(
            f"rank {dist.get_rank()}'s model and rank(s) {', '.join(map(str, differing))}' "
            "differ in their parameters or buffers (names, shapes or dtypes): build the same "
            "model on every rank before wrapping it"
        )
    root = dist.get_global_rank(group, 0) if group is not None else 0
    return broadcast_where_different([(n, t.data) for n, t in named], root, group)
