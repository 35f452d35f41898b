"""Scatter requests: an uneven all-to-all that sends each rank only its own rows.

A :class:`~thinwire.compress.base.Request` of kind ``SCATTER`` gives, for every rank j,
how many leading rows of its tensors go to j. All scatter requests of a round travel
together: rank i's message to rank j holds, per request, the number of rows it sends, then
those rows of each tensor, then a status byte (1: i's input was not finite). Two
collectives: an all-to-all of the messages' lengths, then one of the messages.

Each rank sends and receives only what is addressed to it, so its bytes do not grow with
the number of ranks (the all-gather's do: every rank receives every payload).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from thinwire.comm.framing import as_bytes, frame
from thinwire.compress.base import Request

#: the header of one request in a message: how many rows follow (int64)
_COUNT = torch.empty(0, dtype=torch.int64)


def scatter_round(
    requests: Sequence[Request],
    poison: bool | Tensor,
    world: int,
    rank: int,
    collective: Callable[..., None],
) -> tuple[list[list[list[Tensor]]], bool | Tensor, int, int]:
    """Execute the scatter ``requests`` of one round with ``collective`` (a communicator's
    wrapper of ``torch.distributed`` calls). Returns the answers (per request, per source
    rank, the rows it sent here, tensor by tensor), whether any source was poisoned (a
    device flag where ``poison`` is one), and the bytes this rank sent to and received
    from the others (messages and their lengths, not counting its own)."""
    device = requests[0].tensors[0].device
    starts = [_starts(request.counts) for request in requests]
    messages = []
    for dest in range(world):
        header = torch.tensor([r.counts[dest] for r in requests], dtype=torch.int64)
        parts = [header.to(device)]
        for request, begin in zip(requests, starts, strict=True):
            rows = slice(begin[dest], begin[dest] + request.counts[dest])
            parts.extend(t[rows] for t in request.tensors)
        messages.append(frame(parts, poison, device))
    out_sizes = [m.numel() for m in messages]
    lengths = torch.tensor(out_sizes, dtype=torch.int64).to(device)
    received_lengths = torch.empty_like(lengths)
    collective(dist.all_to_all_single, received_lengths, lengths)
    in_sizes = [int(n) for n in received_lengths.cpu()]
    buffer = torch.empty(sum(in_sizes), dtype=torch.uint8, device=device)
    collective(
        dist.all_to_all_single,
        buffer,
        torch.cat(messages),
        output_split_sizes=in_sizes,
        input_split_sizes=out_sizes,
    )
    answers: list[list[list[Tensor]]] = [[] for _ in requests]
    statuses = []
    for message in buffer.split(in_sizes):  # in source rank order
        for index, rows in enumerate(_decode(message[:-1], requests)):
            answers[index].append(rows)
        statuses.append(message[-1:])
    flags = torch.cat(statuses).any()
    poisoned: bool | Tensor = flags if isinstance(poison, Tensor) else bool(flags)
    control_bytes = 8 * (world - 1)
    sent = sum(out_sizes) - out_sizes[rank] + control_bytes
    received = sum(in_sizes) - in_sizes[rank] + control_bytes
    return answers, poisoned, sent, received


def _starts(counts: Sequence[int] | None) -> list[int]:
    if counts is None:
        raise ValueError("a scatter request needs its counts (use Request.scatter)")
    begin, total = [], 0
    for count in counts:
        begin.append(total)
        total += count
    return begin


def _decode(message: Tensor, requests: Sequence[Request]) -> list[list[Tensor]]:
    """One source's rows for each request, typed and shaped as the requests' tensors."""
    header_bytes = 8 * len(requests)
    counts = [int(n) for n in _view(message[:header_bytes], _COUNT, (len(requests),))]
    offset = header_bytes
    out = []
    for request, count in zip(requests, counts, strict=True):
        rows = []
        for like in request.tensors:
            shape = (count, *like.shape[1:])
            size = math.prod(shape) * like.element_size()
            rows.append(_view(message[offset : offset + size], like, shape))
            offset += size
        out.append(rows)
    return out


def _view(piece: Tensor, like: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``piece``'s bytes as a tensor of ``like``'s dtype shaped ``shape`` (a copy where
    the bytes are misaligned for that dtype)."""
    if piece.storage_offset() % like.element_size():
        piece = piece.clone()
    return piece.view(like.dtype).view(shape)


def scatter_payload_bytes(requests: Sequence[Request]) -> int:
    """The bytes of this rank's rows in ``requests`` (what it contributes)."""
    return sum(as_bytes(t).numel() for r in requests for t in r.tensors)


def merge_flags(a: bool | Tensor, b: bool | Tensor) -> Any:
    """Either round poisoned (bools or device flags)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return torch.as_tensor(a) | torch.as_tensor(b)
    return a or b
