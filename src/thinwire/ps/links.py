"""The two communicators of a parameter server: the worker's link to one server shard
and the server's fan-in from its workers.

Both sides run the same compressor protocols through :class:`~thinwire.GradientExchange`:
the worker on its gradients, the server on zeros of the same shapes (a participant that
contributes nothing). Each round the worker sends its requests' tensors as one byte
message plus a poison byte; the server receives one such message per worker (the shapes
come from its own requests), sums or takes the maximum of ``Sum``/``Max`` payloads and
keeps ``Gather`` payloads apart, so its protocols decode every worker's payload (the
server decompresses and sums) and end with the mean gradient.

Only multi-round protocols (PowerSGD: the sum of P feeds Q) need the server's answers;
for single-round compressors the worker does not wait for one (its mean would go unused:
the server applies the update and the worker pulls parameters) and its protocol is handed
its own payload back, which is all error feedback needs (what this worker sent).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from thinwire.comm.collectives import (
    Communicator,
    RoundResult,
    Traffic,
    _reduce_locally,
    _split_bytes,
)
from thinwire.compress.base import Op, Request
from thinwire.ps.channels import Channel, Pending, as_bytes


def _message(requests: Sequence[Request], poison: bool) -> Tensor:
    tensors = [t for request in requests for t in request.tensors]
    flag = torch.tensor([int(poison)], dtype=torch.uint8)
    return torch.cat([as_bytes(t) for t in tensors] + [flag])


def _nbytes(requests: Sequence[Request]) -> int:
    return sum(t.numel() * t.element_size() for r in requests for t in r.tensors) + 1


def _regroup(requests: Sequence[Request], tensors: list[Tensor]) -> list[list[Tensor]]:
    out, offset = [], 0
    for request in requests:
        out.append(tensors[offset : offset + len(request.tensors)])
        offset += len(request.tensors)
    return out


class ServerLink(Communicator):
    """A worker's communicator to one server shard.

    ``world_size`` is what the compressor divides by: the number of workers for a
    synchronous server, 1 for an asynchronous one (each push is applied on its own).
    ``replies``: whether the server answers each round (multi-round compressors).
    """

    name = "parameter-server"

    checks_start = False  # no group of peers: the server has its own resume protocol

    def __init__(self, channel: Channel, world_size: int, rank: int, replies: bool) -> None:
        self.group = None
        self.world_size = world_size
        self.rank = rank
        self.timeout = None
        self.channel = channel
        self.replies = replies
        self.sends: list[tuple[Pending, Tensor]] = []

    def _execute(self, requests: Sequence[Request], poison: bool) -> RoundResult:
        message = _message(requests, poison)
        self.sends.append((self.channel.send(message), message))
        traffic = Traffic(payload=message.numel(), sent=message.numel(), collectives=1)
        if not self.replies:
            echo = [[list(r.tensors)] if r.op is Op.GATHER else list(r.tensors) for r in requests]
            return RoundResult(echo, False, traffic)
        if any(r.op is Op.GATHER for r in requests):
            raise NotImplementedError("a multi-round protocol that gathers is not supported")
        answer = torch.empty(_nbytes(requests), dtype=torch.uint8)
        self.channel.recv(answer).wait()
        traffic.received += answer.numel()
        tensors = [t for r in requests for t in r.tensors]
        decoded = _split_bytes(answer[:-1], tensors)
        return RoundResult(_regroup(requests, decoded), bool(answer[-1]), traffic)

    def finish_sends(self) -> None:
        """Wait for every message this link started sending."""
        sends, self.sends = self.sends, []
        for pending, _ in sends:
            pending.wait()


class WorkerFanIn(Communicator):
    """The server's communicator: one message per worker per round, combined.

    ``channels``: one per worker. :attr:`active` picks whose messages this exchange takes
    (all for a synchronous step, the pushing worker for an asynchronous one).
    """

    name = "parameter-server"

    checks_start = False  # no group of peers: the server has its own resume protocol

    def __init__(self, channels: Sequence[Channel], world_size: int, replies: bool) -> None:
        self.group = None
        self.world_size = world_size
        self.rank = -1
        self.timeout = None
        self.channels = list(channels)
        self.active: list[int] = list(range(len(self.channels)))
        self.replies = replies

    def _execute(self, requests: Sequence[Request], poison: bool) -> RoundResult:
        size = _nbytes(requests)
        buffers = [torch.empty(size, dtype=torch.uint8) for _ in self.active]
        receiving = [self.channels[w].recv(b) for w, b in zip(self.active, buffers, strict=True)]
        for pending in receiving:
            pending.wait()
        tensors = [t for r in requests for t in r.tensors]
        per_worker = [_regroup(requests, _split_bytes(b[:-1], tensors)) for b in buffers]
        poisoned = any(bool(b[-1]) for b in buffers)
        answers: list[Any] = []
        for index, request in enumerate(requests):
            payloads = [worker[index] for worker in per_worker]
            if request.op is Op.GATHER:
                answers.append(payloads)
            else:
                answers.append(_reduce_locally(request.op, payloads))
        traffic = Traffic(received=size * len(buffers), collectives=1)
        if self.replies:
            reply = _message(
                [Request(r.op, tuple(a)) for r, a in zip(requests, answers, strict=True)], poisoned
            )
            sending = [self.channels[w].send(reply) for w in self.active]
            for pending in sending:
                pending.wait()
            traffic.sent += reply.numel() * len(sending)
        return RoundResult(answers, poisoned, traffic)
