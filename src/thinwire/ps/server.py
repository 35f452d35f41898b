"""One server shard: receives pushes, applies them with its optimizer, answers with
parameters.

Messages (per worker, on its channel): a push is a header ``float64[4] = [kind, step,
version, lr_factor]`` (kind 0: push, 1: the worker is done) followed by the compressor's
round messages (see :mod:`thinwire.ps.links`); the answer is ``float64[2] = [status,
version]`` followed by the shard's parameters as one fp32 vector (status 0: fine, 1: a
non-finite gradient was pushed and nothing was applied).

Synchronous mode takes one push from every worker, averages them and steps once: the
same update as all-reduce SGD. Asynchronous mode applies each push on its own, as it
arrives, as one optimizer step on ``gradient / workers``; a worker's answer (which lets it
compute its next step) is held back while it would be more than ``staleness`` steps
ahead of the slowest worker still running (stale synchronous parallel). Both keep logs:
:attr:`ShardServer.applied` (which version each push was computed on and applied at) and
:attr:`ShardServer.released` (each answer and the slowest worker's clock at that moment).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from thinwire.comm.engine import GradientExchange, GradientItem
from thinwire.compress.base import Compressor
from thinwire.compress.feedback import NoMemory
from thinwire.errors import NonFiniteGradientError, RankMismatchError
from thinwire.ps.channels import Channel
from thinwire.ps.links import WorkerFanIn

PUSH, CLOSE = 0, 1
FINE, POISONED = 0, 1
HEADER, ANSWER = 4, 2


@dataclass(frozen=True)
class Applied:
    """A push as the server applied it: ``worker``'s ``step``, computed on parameters of
    version ``computed_on``, applied to make version ``applied_at``."""

    worker: int
    step: int
    computed_on: int
    applied_at: int

    @property
    def staleness(self) -> int:
        """Updates by others between the pull and this push's application."""
        return self.applied_at - 1 - self.computed_on


@dataclass(frozen=True)
class Released:
    """An answer: ``worker`` may now compute ``next_step``; ``slowest`` was the lowest
    clock (next step) among the workers still running when it was sent."""

    worker: int
    next_step: int
    slowest: int
    version: int


class ShardServer:
    """Owns one shard of the parameters and its optimizer; serves ``channels`` (one per
    worker).

    Args:
        names: the shard's parameter names (keys of the compressor state).
        optimizer: an optimizer over the shard's own parameter tensors.
        compressor: a fresh compressor instance configured as the workers'.
        channels: one channel per worker, in worker order.
        mode: ``"sync"`` or ``"async"``.
        staleness: tau for asynchronous mode (ignored for synchronous).
    """

    def __init__(
        self,
        names: Sequence[str],
        optimizer: torch.optim.Optimizer,
        compressor: Compressor,
        channels: Sequence[Channel],
        mode: str,
        staleness: int = 0,
    ) -> None:
        self.names = list(names)
        self.optimizer = optimizer
        self.params: list[Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.channels = list(channels)
        self.workers = len(self.channels)
        self.mode = mode
        self.staleness = staleness
        replies = compressor.rounds > 1
        self.fan_in = WorkerFanIn(
            self.channels, self.workers if mode == "sync" else 1, replies=replies
        )
        self.engine = GradientExchange(compressor, communicator=self.fan_in, memory=NoMemory())
        self.version = 0
        self.applied: list[Applied] = []
        self.released: list[Released] = []
        self._zeros = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]

    # -- serving ------------------------------------------------------------------------

    def serve(self) -> None:
        """Answer pushes until every worker has said it is done."""
        if self.mode == "sync":
            self._serve_sync()
        else:
            self._serve_async()

    def _serve_sync(self) -> None:
        headers = [torch.empty(HEADER, dtype=torch.float64) for _ in range(self.workers)]
        while True:
            for pending in [c.recv(h) for c, h in zip(self.channels, headers, strict=True)]:
                pending.wait()
            kinds = {int(h[0]) for h in headers}
            if kinds == {CLOSE}:
                return
            steps = {int(h[1]) for h in headers}
            if kinds != {PUSH} or len(steps) != 1:
                raise RankMismatchError(
                    "synchronous parameter server: the workers are out of step (steps "
                    f"{sorted(int(h[1]) for h in headers)}, some done: {CLOSE in kinds}); "
                    "every worker must call step() the same number of times, then close()"
                )
            self.fan_in.active = list(range(self.workers))
            self._apply(steps.pop(), float(headers[0][3]), scale=1.0)
            for worker, header in enumerate(headers):
                self.applied.append(Applied(worker, int(header[1]), int(header[2]), self.version))
            for worker in range(self.workers):
                self._answer(worker, next_step=int(headers[worker][1]) + 1, slowest=-1)

    def _serve_async(self) -> None:
        arrivals: queue.Queue[tuple[int, Tensor | BaseException]] = queue.Queue()
        resume = [threading.Semaphore(0) for _ in range(self.workers)]
        for worker in range(self.workers):
            threading.Thread(
                target=self._receive_headers,
                args=(worker, arrivals, resume[worker]),
                name=f"thinwire-ps-headers-{worker}",
                daemon=True,
            ).start()
        clocks = [0] * self.workers
        running = set(range(self.workers))
        held: set[int] = set()
        while running:
            worker, header = arrivals.get()
            if isinstance(header, BaseException):
                raise header
            if int(header[0]) == CLOSE:
                running.discard(worker)
            else:
                step = int(header[1])
                self.fan_in.active = [worker]
                self._apply(step, float(header[3]), scale=1.0 / self.workers)
                self.applied.append(Applied(worker, step, int(header[2]), self.version))
                clocks[worker] = step + 1
                held.add(worker)
            resume[worker].release()  # the next header may be read
            slowest = min((clocks[w] for w in running), default=max(clocks))
            for waiting in sorted(held):
                if clocks[waiting] - slowest <= self.staleness:
                    held.discard(waiting)
                    self._answer(waiting, next_step=clocks[waiting], slowest=slowest)

    def _receive_headers(
        self,
        worker: int,
        arrivals: queue.Queue[tuple[int, Tensor | BaseException]],
        resume: threading.Semaphore,
    ) -> None:
        """Wait for ``worker``'s next header, hand it over, wait until its push is read."""
        while True:
            header = torch.empty(HEADER, dtype=torch.float64)
            try:
                self.channels[worker].recv(header).wait()
            except BaseException as error:  # handed to the serving thread
                arrivals.put((worker, error))
                return
            arrivals.put((worker, header))
            if int(header[0]) == CLOSE:
                return
            resume.acquire()

    # -- one update ---------------------------------------------------------------------

    def _apply(self, step: int, lr_factor: float, scale: float) -> None:
        """Receive the active workers' payloads, decode, average, step the optimizer."""
        self.engine.step = step
        items = [GradientItem(n, z) for n, z in zip(self.names, self._zeros, strict=True)]
        try:
            means = self.engine.exchange(items)
        except NonFiniteGradientError:
            if not self.fan_in.replies:  # workers wait for an answer: say why there is none
                for worker in self.fan_in.active:
                    self._send_status(worker, POISONED)
            raise
        self.engine.end_step()
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * lr_factor
        with torch.no_grad():
            for p, mean in zip(self.params, means, strict=True):
                p.grad = mean.to(p.dtype).mul_(scale) if scale != 1.0 else mean.to(p.dtype)
        self.optimizer.step()
        self.version += 1

    def _answer(self, worker: int, next_step: int, slowest: int) -> None:
        self.released.append(Released(worker, next_step, slowest, self.version))
        self._send_status(worker, FINE)
        flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in self.params])
        self.channels[worker].send(flat).wait()

    def _send_status(self, worker: int, status: int) -> None:
        answer = torch.tensor([status, self.version], dtype=torch.float64)
        self.channels[worker].send(answer).wait()

    def state(self) -> dict[str, Any]:
        """The shard's parameters and optimizer state (for checkpoints and tests)."""
        return {
            "params": dict(zip(self.names, (p.detach().clone() for p in self.params), strict=True)),
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
        }
