"""The exchange thread: jobs in submission order, also for a job run on the caller's thread."""

from __future__ import annotations

import threading
import time

import pytest

from thinwire.comm.worker import OrderedWorker

pytestmark = pytest.mark.timeout(60)


def test_a_job_run_here_waits_for_the_queued_ones_and_runs_on_this_thread() -> None:
    worker = OrderedWorker(name="test-worker")
    try:
        order: list[str] = []
        threads: dict[str, str] = {}

        def slow(name: str) -> None:
            time.sleep(0.05)
            order.append(name)
            threads[name] = threading.current_thread().name

        queued = [worker.submit(lambda n=n: slow(n)) for n in ("a", "b")]
        here = worker.submit(lambda: slow("here") or "done", here=True)
        assert here.done() and here.value() == "done"  # done on return
        assert all(f.done() for f in queued)
        assert order == ["a", "b", "here"]
        assert threads["a"] == "test-worker" and threads["here"] == threading.current_thread().name
        after = worker.submit(lambda: slow("after"))
        after.wait()
        assert order[-1] == "after"  # the thread goes on with later jobs
    finally:
        worker.close(timeout=5)


def test_a_failing_job_run_here_hands_its_error_to_the_future() -> None:
    worker = OrderedWorker(name="test-worker")
    try:
        failed = worker.submit(lambda: 1 / 0)
        here = worker.submit(lambda: (_ for _ in ()).throw(ValueError("bad bucket")), here=True)
        with pytest.raises(ValueError, match="bad bucket"):
            here.wait()
        with pytest.raises(ZeroDivisionError):  # an earlier failure does not stop it
            failed.wait()
        assert worker.submit(lambda: 7, here=True).value() == 7
    finally:
        worker.close(timeout=5)


def test_a_closed_worker_refuses_jobs_run_here_too() -> None:
    worker = OrderedWorker(name="test-worker")
    worker.close(timeout=5)
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(lambda: None, here=True)
