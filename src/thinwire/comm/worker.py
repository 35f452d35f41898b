"""One background thread per exchange engine, running jobs strictly in submission order.

Collectives must be issued in the same order on every rank. DDP calls its hooks in bucket
order on every rank; running each bucket's whole (possibly multi-round) exchange on one
FIFO thread keeps that order while the main thread goes on with the backward pass.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from thinwire.comm import shutdown


class OrderedWorker:
    """A daemon thread that runs submitted callables one at a time, in order; closed
    before ``group`` (default: the default group) is destroyed and at interpreter exit
    (:mod:`thinwire.comm.shutdown`)."""

    def __init__(self, name: str = "thinwire-exchange", group: Any = None) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], torch.futures.Future] | None] = (
            queue.Queue()
        )
        # jobs submitted and finished, under a condition that a job run here waits on
        self._submitted = self._finished = 0
        self._state = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.closed = False
        shutdown.register(self, group)

    def submit(self, job: Callable[[], Any], here: bool = False) -> torch.futures.Future:
        """Queue ``job``; the returned future holds its result or its exception. With
        ``here``, run it on the calling thread instead, once every job submitted before
        it has finished (a caller that would wait for its result anyway saves the
        hand-over to the thread and back); the future is then done on return."""
        if self.closed:
            raise RuntimeError(
                "thinwire's exchange thread is closed (by close(), or because its process "
                "group was destroyed): make a new engine after init_process_group"
            )
        future: torch.futures.Future = torch.futures.Future()
        with self._state:
            if not here:
                self._submitted += 1
                self._jobs.put((job, future))
                return future
            self._state.wait_for(lambda: self._finished == self._submitted)
            try:  # holding the condition: a job submitted meanwhile waits its turn
                result = job()
            except Exception as error:  # handed to the future, as the thread does
                future.set_exception(error)
            else:
                future.set_result(result)
        return future

    def close(self, timeout: float | None = None) -> None:
        """Finish queued jobs and stop the thread (waiting at most ``timeout`` s)."""
        shutdown.unregister(self)
        self.close_for_shutdown(timeout)

    def close_for_shutdown(self, timeout: float | None) -> None:
        """Finish queued jobs and stop the thread, waiting at most ``timeout`` s."""
        self.closed = True
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, future = item
            try:
                result = job()
            except BaseException as error:  # handed to the waiting thread, not swallowed
                future.set_exception(error)
            else:
                future.set_result(result)
            with self._state:
                self._finished += 1
                self._state.notify_all()
