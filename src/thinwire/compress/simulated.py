"""Many ranks in one process: drive one exchange protocol per rank in lock-step.

Each round's requests are answered as a communicator would answer them (a sum or a
maximum in the payload's dtype, every rank's tensors, or the rows each rank scattered to
this one), and the payload bytes each rank would send to the others are counted: a sum's ring share
``2 (N - 1) / N`` of its bytes, a gather's bytes to each of ``N - 1`` others, a
scatter's rows addressed to others. For tests of protocols at large world sizes and for
modelling their bytes (``bench/sparse_bytes.py``); not a transport.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.base import Compressor, Exchange, Exchanged, Op, Request, Slot


def drive_ranks(protocols: Sequence[Exchange]) -> tuple[list[Exchanged], list[int]]:
    """Run ``protocols`` (rank r's is ``protocols[r]``) to the end; return their outcomes
    and the payload bytes each rank sent to the others. Every rank gets its own copy of
    each answer. Raises ``AssertionError`` if the ranks ask for different kinds of
    collective in a round or finish after different rounds (a protocol bug)."""
    world = len(protocols)
    answers: list[Any] = [None] * world
    results: list[Exchanged | None] = [None] * world
    sent = [0] * world
    while True:
        requests = []
        for rank, protocol in enumerate(protocols):
            try:
                requests.append(protocol.send(answers[rank]))
            except StopIteration as stop:
                results[rank] = stop.value
        if not requests:
            break
        if len(requests) != world or len({r.op for r in requests}) != 1:
            raise AssertionError("the ranks' protocols asked for different rounds")
        answers = _answer(requests, sent)
    return results, sent  # type: ignore[return-value]


def exchange_on_ranks(
    compressors: Sequence[Compressor], tensors: Sequence[Tensor], key: str = "w", step: int = 0
) -> tuple[list[Exchanged], list[int]]:
    """Rank r's ``compressors[r]`` exchanging its ``tensors[r]`` (as tensor ``key`` at
    ``step``) with the others, through :func:`drive_ranks`: the outcomes and the bytes each
    rank sent."""
    world = len(tensors)
    protocols = [
        compressor.exchange(tensor, Slot(key, step, world, rank))
        for rank, (compressor, tensor) in enumerate(zip(compressors, tensors, strict=True))
    ]
    return drive_ranks(protocols)


def _answer(requests: Sequence[Request], sent: list[int]) -> list[Any]:
    world, op = len(requests), requests[0].op
    if op in (Op.SUM, Op.MAX):  # in the payload's dtype, in rank order
        combine = torch.add if op is Op.SUM else torch.maximum
        columns = zip(*(r.tensors for r in requests), strict=True)
        total = [functools.reduce(combine, column) for column in columns]
        for rank, request in enumerate(requests):
            sent[rank] += 2 * (world - 1) * _nbytes(request.tensors) // world
        return [[t.clone() for t in total] for _ in range(world)]
    if op is Op.GATHER:
        for rank, request in enumerate(requests):
            sent[rank] += (world - 1) * _nbytes(request.tensors)
        return [[[t.clone() for t in r.tensors] for r in requests] for _ in range(world)]
    rows = [_rows_by_destination(r) for r in requests]
    for rank in range(world):
        sent[rank] += sum(_nbytes(rows[rank][dest]) for dest in range(world) if dest != rank)
    columns = range(len(requests[0].tensors))
    return [
        [torch.cat([rows[source][dest][c] for source in range(world)]) for c in columns]
        for dest in range(world)
    ]


def _nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _rows_by_destination(request: Request) -> list[list[Tensor]]:
    counts = list(request.counts or ())
    pieces = [t.split(counts) for t in request.tensors]
    return [[p[dest].clone() for p in pieces] for dest in range(len(counts))]
