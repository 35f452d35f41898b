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


class OrderedWorker:
    """A daemon thread that runs submitted callables one at a time, in order."""

    def __init__(self, name: str = "thinwire-exchange") -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], torch.futures.Future] | None] = (
            queue.Queue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> torch.futures.Future:
        """Queue ``job``; the returned future holds its result or its exception."""
        future: torch.futures.Future = torch.futures.Future()
        self._jobs.put((job, future))
        return future

    def close(self) -> None:
        """Finish queued jobs and stop the thread."""
        self._jobs.put(None)
        self._thread.join()

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
