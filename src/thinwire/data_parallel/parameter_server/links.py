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

from thinwire.comm.collectives import Communicator, RoundResult, Traffic, reduce_locally
from thinwire.comm.framing import frame, framed_size, unframe
from thinwire.compress.base import Op, Request
from thinwire.data_parallel.parameter_server.channels import Channel, Pending


def _tensors(requests: Sequence[Request]) -> list[Tensor]:
    return [t for request in requests for t in request.tensors]


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

    def supports(self, op: Op) -> bool:
        """Everything but scatters (the server is the one peer a worker talks to)."""
        return op is not Op.SCATTER

    def __init__(self, channel: Channel, world_size: int, rank: int, replies: bool) -> None:
        super().__init__(world_size=world_size, rank=rank)
        self.channel = channel
        self.replies = replies
        self.sends: list[tuple[Pending, Tensor]] = []

    def _execute(
        self, requests: Sequence[Request], poison: bool | Tensor, lazy: bool
    ) -> RoundResult:
        # messages are read on the host: the verdict is a bool (``lazy`` changes nothing)
        message = frame(_tensors(requests), bool(poison))
        self.sends.append((self.channel.send(message), message))
        traffic = Traffic(payload=message.numel(), sent=message.numel(), collectives=1)
        if not self.replies:
            echo = [[list(r.tensors)] if r.op is Op.GATHER else list(r.tensors) for r in requests]
            return RoundResult(echo, False, traffic)
        if any(r.op is Op.GATHER for r in requests):
            raise NotImplementedError("a multi-round protocol that gathers is not supported")
        tensors = _tensors(requests)
        answer = torch.empty(framed_size(tensors), dtype=torch.uint8)
        self.channel.recv(answer).wait()
        traffic.received += answer.numel()
        decoded, poisoned = unframe(answer, tensors)
        return RoundResult(_regroup(requests, decoded), poisoned, traffic)

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

    def supports(self, op: Op) -> bool:
        """Everything but scatters (the server is the one peer a worker talks to)."""
        return op is not Op.SCATTER

    def __init__(self, channels: Sequence[Channel], world_size: int, replies: bool) -> None:
        super().__init__(world_size=world_size, rank=-1)  # the server is no worker
        self.channels = list(channels)
        self.active: list[int] = list(range(len(self.channels)))
        self.replies = replies

    def _execute(
        self, requests: Sequence[Request], poison: bool | Tensor, lazy: bool
    ) -> RoundResult:
        tensors = _tensors(requests)  # the server has no gradients of its own to poison
        size = framed_size(tensors)
        buffers = [torch.empty(size, dtype=torch.uint8) for _ in self.active]
        receiving = [self.channels[w].recv(b) for w, b in zip(self.active, buffers, strict=True)]
        for pending in receiving:
            pending.wait()
        messages = [unframe(b, tensors) for b in buffers]
        per_worker = [_regroup(requests, decoded) for decoded, _ in messages]
        poisoned = any(flag for _, flag in messages)
        answers: list[Any] = []
        for index, request in enumerate(requests):
            payloads = [worker[index] for worker in per_worker]
            if request.op is Op.GATHER:
                answers.append(payloads)
            else:
                answers.append(reduce_locally(request.op, payloads))
        traffic = Traffic(received=size * len(buffers), collectives=1)
        if self.replies:
            reply = frame([t for answer in answers for t in answer], poisoned)
            sending = [self.channels[w].send(reply) for w in self.active]
            for pending in sending:
                pending.wait()
            traffic.sent += reply.numel() * len(sending)
        return RoundResult(answers, poisoned, traffic)
