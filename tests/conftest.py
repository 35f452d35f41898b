"""Shared fixtures: process pools spawned once per test module (and again after a failure)."""

from __future__ import annotations

import os
import queue
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.multiprocessing as mp

from thinwire.launch import LocalPool, free_port

os.environ.setdefault("OMP_NUM_THREADS", "1")


class RestartingPool:
    """A :class:`LocalPool` that is started on first use and restarted after a failure,
    so one failing test does not take the rest of its module down with it."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._pool: LocalPool | None = None

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank."""
        if self._pool is None or self._pool.closed:
            self._pool = LocalPool(self.world_size, collective_timeout_s=60)
        return self._pool.run(fn, *args, timeout=timeout)

    def close(self) -> None:
        """Stop the processes."""
        if self._pool is not None:
            self._pool.close()


def _pool(world_size: int) -> Iterator[RestartingPool]:
    pool = RestartingPool(world_size)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def pool2() -> Iterator[RestartingPool]:
    """Two gloo ranks on 127.0.0.1, shared by the tests of one module."""
    yield from _pool(2)


@pytest.fixture(scope="module")
def pool4() -> Iterator[RestartingPool]:
    """Four gloo ranks on 127.0.0.1, shared by the tests of one module."""
    yield from _pool(4)


@pytest.fixture(scope="module")
def pool8() -> Iterator[RestartingPool]:
    """Eight gloo ranks on 127.0.0.1 (hybrid plans), shared by the tests of one module."""
    yield from _pool(8)


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def pool(request: pytest.FixtureRequest) -> RestartingPool:
    """Each test that asks for ``pool`` runs on 2 and on 4 ranks."""
    return request.getfixturevalue(f"pool{request.param}")


def _first_report(target: Callable[..., None], *args: Any, timeout: float = 60.0) -> Any:
    """Start ``target(rank, port, *args, results)`` on two fresh spawned processes (ranks 0
    and 1) and return the first item either puts on ``results``; fail the test if none
    comes within ``timeout`` s (a hang). The processes are stopped afterwards."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, results)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        return results.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"no rank reported within {timeout:.0f} s: a hang")
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


@pytest.fixture
def first_report() -> Callable[..., Any]:
    """Two fresh processes racing to report (for tests where one rank dies or stalls)."""
    return _first_report
