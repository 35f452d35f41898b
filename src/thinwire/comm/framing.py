"""Byte framing: a round's tensors as one flat byte message with a status byte at its end.

Gathers and point-to-point messages carry tensors of several dtypes and shapes at once; the
receiver knows the shapes from its own requests (every rank runs the same protocol), so the
message is just the tensors' bytes one after another, plus one status byte (1: the sender's
input was not finite, the round is poisoned).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def as_bytes(tensor: Tensor) -> Tensor:
    """``tensor``'s bytes as a flat uint8 tensor (a copy only if it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def frame(
    tensors: Sequence[Tensor], poison: bool | Tensor, device: torch.device | None = None
) -> Tensor:
    """``tensors``' bytes one after another, then the status byte (``poison``: a bool, or
    a bool tensor on ``device``, which is not read back)."""
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    if isinstance(poison, Tensor):
        status = poison.reshape(1).to(device=device, dtype=torch.uint8)
    else:  # a fill, not a copy from the host: on a GPU such a copy makes the host wait
        status = torch.full((1,), int(poison), dtype=torch.uint8, device=device)
    return torch.cat([as_bytes(t) for t in tensors] + [status])


def framed_size(tensors: Sequence[Tensor]) -> int:
    """The length of :func:`frame`'s message for tensors shaped as ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors) + 1


def unframe(message: Tensor, like: Sequence[Tensor]) -> tuple[list[Tensor], bool]:
    """The tensors of a :func:`frame` message, shaped and typed as ``like``, and whether it
    was poisoned."""
    return split_bytes(message[:-1], like), bool(message[-1])


def split_bytes(buffer: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Views of ``buffer``'s bytes as tensors shaped and typed as ``like`` (copies where a
    piece is misaligned for its dtype)."""
    sizes = [t.numel() * t.element_size() for t in like]
    out = []
    for piece, t in zip(buffer.split_with_sizes(sizes), like, strict=True):
        if piece.storage_offset() % t.element_size():
            piece = piece.clone()  # misaligned for a view as t.dtype: copy (payloads are small)
        out.append(piece.view(t.dtype).view(t.shape))
    return out
