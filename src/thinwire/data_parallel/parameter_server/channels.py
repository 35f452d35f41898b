"""Point-to-point channels between a worker and a server shard.

A channel carries flat tensors in one direction pair (worker <-> server) and hides where
the other end is: another process (``torch.distributed`` isend/irecv on a tag of its own,
so a process that is both worker and server keeps the two conversations apart) or the same
process (a server thread beside the worker: an in-process queue, as gloo cannot send to
its own rank). Failures and timeouts become :class:`~thinwire.errors.CommunicationError`.
"""

from __future__ import annotations

import datetime
import queue
import time
from abc import ABC, abstractmethod
from typing import Any

import torch.distributed as dist
from torch import Tensor

from thinwire.errors import CommunicationError

#: tags that keep the two directions of a worker/server pair apart
TO_SERVER, TO_WORKER = 11, 12


class Pending(ABC):
    """A send or receive in flight."""

    @abstractmethod
    def wait(self) -> None:
        """Block until it completed; raise :class:`CommunicationError` if it failed."""


class Channel(ABC):
    """One end of a worker/server conversation."""

    #: what the other end is, for error messages
    peer: str

    @abstractmethod
    def send(self, tensor: Tensor) -> Pending:
        """Start sending ``tensor`` (keep it unchanged until the send is waited for)."""

    @abstractmethod
    def recv(self, tensor: Tensor) -> Pending:
        """Start receiving into ``tensor`` (same size and dtype as the sender's)."""


class _Work(Pending):
    def __init__(self, work: Any, what: str, timeout: datetime.timedelta | None) -> None:
        self._work, self._what, self._timeout = work, what, timeout

    def wait(self) -> None:
        try:
            if self._timeout is None:
                self._work.wait()
            else:
                self._work.wait(self._timeout)
        except RuntimeError as error:
            raise CommunicationError(
                f"{self._what} failed or timed out (timeout: {self._timeout}): the other end "
                f"has probably died or stalled; check its output. ({error})"
            ) from error


class ProcessChannel(Channel):
    """To rank ``peer_rank`` of ``group`` over ``torch.distributed`` point-to-point.

    ``sends``/``receives``: the tags of the two directions seen from this end.
    """

    def __init__(
        self,
        peer_rank: int,
        sends: int,
        receives: int,
        group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        self.peer_rank = peer_rank
        self.peer = f"rank {peer_rank}"
        self._sends, self._receives = sends, receives
        self._group, self._timeout = group, timeout
        self._global = dist.get_global_rank(group, peer_rank) if group is not None else peer_rank

    def send(self, tensor: Tensor) -> Pending:
        """Start an ``isend`` to the peer."""
        try:
            work = dist.isend(tensor, dst=self._global, group=self._group, tag=self._sends)
        except RuntimeError as error:
            raise CommunicationError(f"sending to {self.peer} failed: {error}") from error
        return _Work(work, f"sending {tensor.numel()} values to {self.peer}", self._timeout)

    def recv(self, tensor: Tensor) -> Pending:
        """Start an ``irecv`` from the peer."""
        try:
            work = dist.irecv(tensor, src=self._global, group=self._group, tag=self._receives)
        except RuntimeError as error:
            raise CommunicationError(f"receiving from {self.peer} failed: {error}") from error
        return _Work(work, f"receiving {tensor.numel()} values from {self.peer}", self._timeout)


class _Done(Pending):
    def wait(self) -> None:
        """Nothing to wait for."""


class _Take(Pending):
    def __init__(self, end: LocalChannel, into: Tensor) -> None:
        self._end, self._into = end, into

    def wait(self) -> None:
        end = self._end
        deadline = time.monotonic() + end.timeout
        while True:
            try:  # what the other side sent before it failed (e.g. why it failed) comes first
                tensor = end.into.get_nowait()
                break
            except queue.Empty:
                pass
            if end.pair.failure is not None:
                raise CommunicationError(
                    f"the other side in this process failed: {end.pair.failure}"
                ) from end.pair.failure
            try:
                tensor = end.into.get(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
                break
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise CommunicationError(
                        f"nothing arrived from the other side in this process in "
                        f"{end.timeout:.0f} s: it has stalled"
                    ) from None
        if tensor.numel() != self._into.numel() or tensor.dtype != self._into.dtype:
            raise CommunicationError(
                f"in-process message of {tensor.numel()} {tensor.dtype} values where "
                f"{self._into.numel()} {self._into.dtype} were expected: the two sides disagree"
            )
        self._into.copy_(tensor.view_as(self._into))


class LocalPair:
    """Two queues joining two threads of one process; ``failure`` (set by a side that
    failed) wakes the other side's waits with an error instead of a timeout."""

    def __init__(self, timeout: float) -> None:
        self.up: queue.Queue[Tensor] = queue.Queue()
        self.down: queue.Queue[Tensor] = queue.Queue()
        self.failure: BaseException | None = None
        self.worker_end = LocalChannel(self, self.up, self.down, timeout)
        self.server_end = LocalChannel(self, self.down, self.up, timeout)


class LocalChannel(Channel):
    """One end of a :class:`LocalPair`."""

    def __init__(
        self, pair: LocalPair, out: queue.Queue[Tensor], into: queue.Queue[Tensor], timeout: float
    ) -> None:
        self.peer = "this process"
        self.pair, self.out, self.into, self.timeout = pair, out, into, timeout

    def send(self, tensor: Tensor) -> Pending:
        """Hand a copy of ``tensor`` to the other end."""
        self.out.put(tensor.clone())
        return _Done()

    def recv(self, tensor: Tensor) -> Pending:
        """Take the other end's next tensor into ``tensor`` when waited for."""
        return _Take(self, tensor)
