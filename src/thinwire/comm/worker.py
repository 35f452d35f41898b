"""One background thread per exchange engine, running jobs strictly in submission order.

Collectives must be issued in the same order on every rank. DDP calls its hooks in bucket
order on every rank; running each bucket's whole (possibly multi-round) exchange on one
FIFO thread keeps that order while the main thread goes on with the backward pass.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

#: how long the interpreter's exit waits for a worker's job under way (a collective that
#: a dead peer never completes must not hold the exit for the group's whole timeout)
EXIT_WAIT_S = 10.0

_live: weakref.WeakSet[OrderedWorker] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Let every worker finish its jobs and stop before the interpreter tears down: a
    daemon thread still inside a collective while the process groups are destroyed can
    abort the process (SIGABRT) instead of letting it exit with its own code."""
    for worker in list(_live):
        worker.close(timeout=EXIT_WAIT_S)


class OrderedWorker:
    """A daemon thread that runs submitted callables one at a time, in order."""

    def __init__(self, name: str = "thinwire-exchange") -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], torch.futures.Future] | None] = (
            queue.Queue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    def submit(self, job: Callable[[], Any]) -> torch.futures.Future:
        """Queue ``job``; the returned future holds its result or its exception."""
        future: torch.futures.Future = torch.futures.Future()
        self._jobs.put((job, future))
        return future

    def close(self, timeout: float | None = None) -> None:
        """Finish queued jobs and stop the thread (waiting at most ``timeout`` s)."""
        _live.discard(self)
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
