"""Scatter requests: an uneven all-to-all that sends each rank only its own rows.

A :class:`~thinwire.compress.base.Request` of kind ``SCATTER`` gives, for every rank j,
how many leading rows of its tensors go to j; the answer holds, for each of its tensors,
the rows every rank sent this one, one after another in source rank order. All scatter
requests of a round travel together: rank i's message to rank j holds a header (per
request, the number of rows it sends, as int64), then per request and tensor those rows,
then a status block of 8 to 15 bytes (its first byte 1: i's input was not finite), so
that every message is a whole number of 8-byte words and the next one stays aligned. Two
collectives: an all-to-all of the messages' lengths (each rank's to every rank, with its
pacing budget, so that all know every message's), then one of the messages, paced
where ``THINWIRE_PACE_BYTES`` asks for it so that a rank's large messages do not all burst
into their receivers' links at once (:mod:`thinwire.comm.paced`).

The messages are cut from the requests' tensors, and the answers from what arrived, each
by one gather over ranges worked out for all ranks and tensors at once, not a slice per
rank and tensor (at 16 ranks a round of 20 requests of two tensors would otherwise cut
640 pieces and view 640 more).

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

from thinwire.comm import paced
from thinwire.comm.framing import as_bytes
from thinwire.compress.base import Request

#: bytes of a message's status block, at least (padded to end the message on a word)
STATUS_BYTES = 8
#: an integer dtype per width: the gathers move words of the widest width every piece allows
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def scatter_round(
    requests: Sequence[Request],
    poison: bool | Tensor,
    world: int,
    rank: int,
    collective: Callable[..., None],
) -> tuple[list[list[Tensor]], bool | Tensor, int, int]:
    """Execute the scatter ``requests`` of one round with ``collective`` (a communicator's
    wrapper of ``torch.distributed`` calls). Returns the answers (per request, its
    tensors' rows from every rank in rank order), whether any source was poisoned (a
    device flag where ``poison`` is one), and the bytes this rank sent to and received
    from the others (messages and their lengths, not counting its own)."""
    layout = _Layout(requests, world)
    device = layout.columns[0].device
    counts = torch.tensor([_counts(r, world) for r in requests], dtype=torch.int64)  # R x N
    header = counts.t().contiguous()  # row j: what goes to rank j
    status = _status_block(poison, device)
    source = torch.cat([as_bytes(header).to(device), status, *map(as_bytes, layout.columns)])
    # per destination: its header, each column's rows for it, the status block (padded
    # so that the message is a whole number of words)
    column_starts = layout.column_offsets + layout.row_bytes * _row_starts(counts)[layout.owner]
    column_lengths = (counts[layout.owner] * layout.row_bytes).t()  # destination x column
    header_bytes = 8 * len(requests)
    padding = (-(header_bytes + column_lengths.sum(dim=1, keepdim=True))) % 8
    starts = torch.cat(
        [
            (torch.arange(world) * header_bytes).unsqueeze(1),
            layout.base + column_starts.t(),
            torch.full((world, 1), world * header_bytes),
        ],
        dim=1,
    )
    lengths = torch.cat(
        [torch.full((world, 1), header_bytes), column_lengths, STATUS_BYTES + padding], dim=1
    )
    out_sizes = lengths.sum(dim=1).tolist()
    messages = _gather_ranges(source, starts.reshape(-1), lengths.reshape(-1), layout.unit)
    # every rank's lengths and pacing budget to every rank: each rank's own lengths, and
    # whether anyone paces (the ranks agree on it even where their budgets differ)
    sizes = torch.tensor([*out_sizes, paced.PACE_BYTES], dtype=torch.int64).to(device)
    every = torch.empty(world * (world + 1), dtype=torch.int64, device=device)
    collective(dist.all_to_all_single, every, sizes.repeat(world))
    rows = every.view(world, world + 1).tolist()
    every_sizes, budgets = [row[:world] for row in rows], [row[world] for row in rows]
    in_sizes = [row[rank] for row in every_sizes]
    buffer = torch.empty(sum(in_sizes), dtype=torch.uint8, device=device)
    collective(
        paced.paced_all_to_all,
        buffer,
        messages,
        output_split_sizes=in_sizes,
        input_split_sizes=out_sizes,
        every_split_sizes=every_sizes,
        budgets=budgets,
    )
    answers, flags = _unpack(buffer, in_sizes, layout, len(requests))
    poisoned: bool | Tensor = flags if isinstance(poison, Tensor) else bool(flags)
    control_bytes = 8 * (world + 1) * (world - 1)
    sent = sum(out_sizes) - out_sizes[rank] + control_bytes
    received = sum(in_sizes) - in_sizes[rank] + control_bytes
    return answers, poisoned, sent, received


class _Layout:
    """The requests' tensors as columns: each one's bytes per row, its request, where its
    bytes start in the sender's source buffer, and the word width every piece allows."""

    def __init__(self, requests: Sequence[Request], world: int) -> None:
        self.columns = [t for r in requests for t in r.tensors]
        self.shapes = [tuple(t.shape[1:]) for t in self.columns]
        self.dtypes = [t.dtype for t in self.columns]
        self.owner = torch.tensor([i for i, r in enumerate(requests) for _ in r.tensors])
        row_bytes = [math.prod(t.shape[1:]) * t.element_size() for t in self.columns]
        self.row_bytes = torch.tensor(row_bytes, dtype=torch.int64).unsqueeze(1)
        sizes = [t.shape[0] * b for t, b in zip(self.columns, row_bytes, strict=True)]
        self.column_offsets = torch.tensor([0, *sizes[:-1]], dtype=torch.int64).cumsum(0)
        self.column_offsets = self.column_offsets.unsqueeze(1)
        #: where the columns start in the source buffer (after the headers and the status)
        self.base = world * 8 * len(requests) + 2 * STATUS_BYTES
        self.unit = math.gcd(8, *row_bytes)
        self.requests = [len(r.tensors) for r in requests]


def _counts(request: Request, world: int) -> tuple[int, ...]:
    if request.counts is None:
        raise ValueError("a scatter request needs its counts (use Request.scatter)")
    if len(request.counts) != world:
        raise ValueError(
            f"a scatter request has counts for {len(request.counts)} ranks, but the group "
            f"has {world}"
        )
    return request.counts


def _row_starts(counts: Tensor) -> Tensor:
    """Per request (row of ``counts``) the first row that goes to each rank."""
    return counts.cumsum(dim=1) - counts


def _status_block(poison: bool | Tensor, device: torch.device) -> Tensor:
    """The status block and its padding: 1 in its first byte if ``poison``, zeros after it. A
    device flag is not read back; a bool is filled in, not copied from the host."""
    block = torch.zeros(2 * STATUS_BYTES, dtype=torch.uint8, device=device)
    if isinstance(poison, Tensor):
        block[:1] = poison.reshape(1).to(device=device, dtype=torch.uint8)
    elif poison:
        block[:1] = 1
    return block


def _gather_ranges(source: Tensor, starts: Tensor, lengths: Tensor, unit: int) -> Tensor:
    """The byte ranges ``[starts[i], starts[i] + lengths[i])`` of ``source`` one after
    another, moved ``unit`` bytes at a time (every start and length a multiple of it)."""
    words = source.view(_WORDS[unit])
    starts, lengths = starts // unit, lengths // unit
    total = int(lengths.sum())
    shift = starts - (lengths.cumsum(0) - lengths)  # where each range's words come from
    index = torch.arange(total) + torch.repeat_interleave(shift, lengths, output_size=total)
    return words.index_select(0, index.to(source.device)).view(torch.uint8)


def _unpack(
    buffer: Tensor, in_sizes: Sequence[int], layout: _Layout, requests: int
) -> tuple[list[list[Tensor]], Tensor]:
    """Each request's tensors, rows from every source in rank order, and the sources'
    statuses (any poisoned) from the received messages."""
    world, header_bytes = len(in_sizes), 8 * requests
    message_starts = torch.tensor([0, *in_sizes[:-1]], dtype=torch.int64).cumsum(0)
    headers = (
        _gather_ranges(buffer, message_starts, torch.full((world,), header_bytes), 8)
        .view(torch.int64)
        .view(world, requests)
        .cpu()
    )  # source x request: rows it sent here
    lengths = headers[:, layout.owner] * layout.row_bytes.t()  # source x column
    starts = message_starts.unsqueeze(1) + header_bytes + lengths.cumsum(dim=1) - lengths
    statuses = message_starts + header_bytes + lengths.sum(dim=1)
    flags = buffer.index_select(0, statuses.to(buffer.device)).any()
    # column by column, each column's rows from every source in rank order
    arranged = _gather_ranges(buffer, starts.t().reshape(-1), lengths.t().reshape(-1), layout.unit)
    pieces = arranged.split(lengths.sum(dim=0).tolist())
    rows = headers.sum(dim=0)[layout.owner].tolist()
    kinds = zip(pieces, layout.dtypes, rows, layout.shapes, strict=True)
    columns = [_typed(piece, dtype, (count, *shape)) for piece, dtype, count, shape in kinds]
    answers, at = [], 0
    for width in layout.requests:
        answers.append(columns[at : at + width])
        at += width
    return answers, flags


def _typed(piece: Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    """``piece``'s bytes as ``dtype`` shaped ``shape`` (a copy where they are misaligned
    for that dtype)."""
    if piece.storage_offset() % dtype.itemsize:
        piece = piece.clone()
    typed = piece.view(dtype)
    return typed if len(shape) == 1 else typed.view(shape)


def scatter_payload_bytes(requests: Sequence[Request]) -> int:
    """The bytes of this rank's rows in ``requests`` (what it contributes)."""
    return sum(as_bytes(t).numel() for r in requests for t in r.tensors)


def merge_flags(a: bool | Tensor, b: bool | Tensor) -> Any:
    """Either round poisoned (bools or device flags)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return torch.as_tensor(a) | torch.as_tensor(b)
    return a or b
