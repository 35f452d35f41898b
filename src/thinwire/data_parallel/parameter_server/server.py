"""One server shard: receives pushes, applies them with its optimizer, answers with
parameters.

Messages (per worker, on its channel): a push is a header ``float64[4] = [kind, step,
version, lr_factor]`` (kind 0: push, 1: the worker is done, 2: a checkpoint) followed, for
a push, by the compressor's round messages (see
:mod:`thinwire.data_parallel.parameter_server.links`); the answer is
``float64[2] = [status, version]`` followed by the shard's parameters as one fp32 vector
(status 0: fine, 1: a non-finite gradient was pushed and nothing was applied).

A checkpoint is a barrier: once every running worker has asked for one at the same step
(each after its previous push was answered, so every push before it is applied), the
shard copies its state into :attr:`ShardServer.snapshot` and answers each of them with the
parameters, so all resume from the weights that were saved.

Synchronous mode takes one push from every worker, averages them and steps once: the
same update as all-reduce SGD. Asynchronous mode applies each push on its own, as it
arrives, as one optimizer step on ``gradient / workers``; a worker's answer (which lets it
compute its next step) is held back while it would be more than ``staleness`` steps
ahead of the slowest worker still running (stale synchronous parallel). Both keep logs:
:attr:`ShardServer.applied` (which version each push was computed on and applied at) and
:attr:`ShardServer.released` (each answer and the slowest worker's clock at that moment),
the last :data:`LOG_LENGTH` entries of each, so a long job's memory stays flat.
"""

from __future__ import annotations

import collections
import copy
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
from thinwire.data_parallel.parameter_server.channels import Channel
from thinwire.data_parallel.parameter_server.links import WorkerFanIn
from thinwire.data_parallel.parameter_server.sharding import wire_dtype
from thinwire.errors import NonFiniteGradientError, RankMismatchError

PUSH, CLOSE, SNAPSHOT = 0, 1, 2
FINE, POISONED = 0, 1
HEADER, ANSWER = 4, 2
#: entries kept in each of a shard's logs (about 100 bytes each)
LOG_LENGTH = 100_000


def base_rate(group: dict[str, Any]) -> float:
    """The learning rate a push's ``lr_factor`` scales: the group's ``initial_lr`` where a
    scheduler set one (its rate may already be scheduled down, to 0 in a warm-up), else its
    ``lr`` as built."""
    return float(group.get("initial_lr", group["lr"]))


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
        self.base_lrs = [base_rate(g) for g in optimizer.param_groups]
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
        #: the last LOG_LENGTH pushes applied and answers released, oldest first
        self.applied: collections.deque[Applied] = collections.deque(maxlen=LOG_LENGTH)
        self.released: collections.deque[Released] = collections.deque(maxlen=LOG_LENGTH)
        #: the state taken at the last checkpoint (see :meth:`state`)
        self.snapshot: dict[str, Any] | None = None
        #: asynchronous mode: each worker's clock (the step it computes next)
        self.clocks = [0] * self.workers
        #: set once the shard may serve: a checkpoint may still be loaded until then
        self.open = threading.Event()
        self._zeros = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]

    # -- serving ------------------------------------------------------------------------

    def serve(self) -> None:
        """Answer pushes until every worker has said it is done (once :attr:`open` is
        set: until then, pushes wait in their channels and a checkpoint can be loaded)."""
        self.open.wait()
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
            if len(kinds) != 1 or CLOSE in kinds or len(steps) != 1:
                raise RankMismatchError(
                    "synchronous parameter server: the workers are out of step (steps "
                    f"{sorted(int(h[1]) for h in headers)}, some done: {CLOSE in kinds}, "
                    f"some checkpointing: {SNAPSHOT in kinds}); every worker must call step() "
                    "the same number of times, state_dict() at the same step, then close()"
                )
            if kinds == {SNAPSHOT}:
                self._checkpoint(range(self.workers), steps.pop())
                continue
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
        clocks = self.clocks  # a restored checkpoint sets them before the first push
        running = set(range(self.workers))
        held: set[int] = set()
        checkpointing: dict[int, int] = {}  # worker -> the step it checkpoints at
        while running:
            worker, header = arrivals.get()
            if isinstance(header, BaseException):
                raise header
            if int(header[0]) == CLOSE:
                running.discard(worker)
                if checkpointing:
                    raise RankMismatchError(
                        f"asynchronous parameter server: worker {worker} closed while "
                        f"worker(s) {sorted(checkpointing)} waited at a checkpoint; every "
                        "worker must call state_dict() after the same number of steps"
                    )
            elif int(header[0]) == SNAPSHOT:
                checkpointing[worker] = int(header[1])
            else:
                step = int(header[1])
                self.fan_in.active = [worker]
                self._apply(step, float(header[3]), scale=1.0 / self.workers)
                self.applied.append(Applied(worker, step, int(header[2]), self.version))
                clocks[worker] = step + 1
                held.add(worker)
            resume[worker].release()  # the next header may be read
            if checkpointing and running <= set(checkpointing):
                if len(set(checkpointing.values())) != 1:
                    raise RankMismatchError(
                        "asynchronous parameter server: the workers asked for a checkpoint "
                        f"at different steps ({dict(sorted(checkpointing.items()))}, worker: "
                        "step); every worker must call state_dict() after the same number "
                        "of steps"
                    )
                self._checkpoint(sorted(checkpointing), next(iter(checkpointing.values())))
                checkpointing.clear()
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
        items = [GradientItem(n, z) for n, z in zip(self.names, self._zeros, strict=True)]
        try:
            ((_, means),) = self.engine.exchange_bucket(items, last=True, step=step)
        except NonFiniteGradientError:
            if not self.fan_in.replies:  # workers wait for an answer: say why there is none
                for worker in self.fan_in.active:
                    self._send_status(worker, POISONED)
            raise
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
        dtype = wire_dtype(self.params)
        flat = torch.cat([p.detach().reshape(-1).to(dtype) for p in self.params])
        self.channels[worker].send(flat).wait()

    def _send_status(self, worker: int, status: int) -> None:
        answer = torch.tensor([status, self.version], dtype=torch.float64)
        self.channels[worker].send(answer).wait()

    def _checkpoint(self, workers: Sequence[int] | range, step: int) -> None:
        """Copy the shard's state into :attr:`snapshot`, then answer ``workers``."""
        self.snapshot = {**self.state(), "step": step}
        for worker in workers:
            self._answer(worker, next_step=step, slowest=-1)

    def state(self) -> dict[str, Any]:
        """A copy of the shard's parameters, optimizer state, version and exchange state
        (the compressor's, which decodes the workers' payloads)."""
        return copy.deepcopy(
            {
                "names": list(self.names),
                "params": [p.detach() for p in self.params],
                "optimizer": self.optimizer.state_dict(),
                "version": self.version,
                "engine": self.engine.state_dict(),
            }
        )

    def check_restorable(self, state: dict[str, Any]) -> None:
        """Raise if :meth:`restore` would refuse ``state`` (nothing is changed)."""
        if not isinstance(state, dict) or list(state.get("names", [])) != self.names:
            names = list(state.get("names", [])) if isinstance(state, dict) else state
            raise ValueError(
                f"this checkpoint's server shard holds other parameters ({names!r:.80} "
                f"against {self.names!r:.80}): load it into a ParameterServer built with the "
                "same model, servers and ranks"
            )
        self.engine.check_state(state["engine"])

    def restore(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state` returned (the shard must have the same parameters).
        Only before the shard serves (:attr:`open` not yet set)."""
        self.check_restorable(state)
        if self.open.is_set():
            raise RuntimeError("a shard's checkpoint can only be loaded before it serves")
        with torch.no_grad():
            for p, saved in zip(self.params, state["params"], strict=True):
                p.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.engine.load_state_dict(state["engine"])
        self.clocks[:] = [int(state.get("step", 0))] * self.workers
