"""Shared fixtures: process pools spawned once per test module (and again after a failure)."""

from __future__ import annotations

import os
import queue
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from thinwire.launch import LocalPool, free_port, process_context

os.environ.setdefault("OMP_NUM_THREADS", "1")
# without a GPU, Triton (imported later, if at all) runs its kernels through its
# interpreter, on CPU tensors: the fused kernels' tests (tests/test_fused_selection.py)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# ranks fork from a server that imported these once (thinwire.launch.process_context): eight
# ranks each importing transformers cost 8 x 4 s of CPU per pool on this 2-core machine
os.environ.setdefault(
    "THINWIRE_PRELOAD",
    "transformers.models.llama.modeling_llama,transformers.models.gpt2.modeling_gpt2",
)


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
    """Start ``target(rank, port, *args, results)`` on two fresh processes (ranks 0
    and 1) and return the first item either puts on ``results``; fail the test if none
    comes within ``timeout`` s (a hang). The processes are stopped afterwards."""
    ctx = process_context()
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


#: modules whose tests build network namespaces or emulated clusters, or assert that none
#: is left: under ``pytest -n`` they share one worker, one test at a time
NAMESPACE_MODULES = frozenset(
    {
        "test_bench_methods.py",
        "test_bench_records.py",
        "test_cluster.py",
        "test_hybrid_sleep.py",
        "test_link_faults.py",
        "test_plan_spec.py",
        "test_private_loopback.py",
    }
)
#: the modules that take longest, started first under ``pytest -n`` so that no worker is
#: left with a long module at the end (a scheduling hint only: any order is correct)
LONGEST_FIRST = (
    "test_parallel_parity.py",
    "test_training.py",
    "test_examples.py",
    "test_delayed_agreement.py",
    "test_delayed_refusals.py",
    "test_checkpoint.py",
    "test_integrations.py",
    "test_sparse_training.py",
    "test_sparse_refusals.py",
    "test_errors_gradients.py",
    "test_errors_misuse.py",
    "test_ps_training.py",
    "test_ps_errors.py",
    "test_parallel_errors.py",
)


def _work_group(item: pytest.Item) -> str:
    """The unit of work an ``-n`` worker takes whole: the namespace group, else the module
    (so that a module's process pools are spawned once)."""
    module = item.path.name
    return "namespaces" if module in NAMESPACE_MODULES else module


def _start_rank(group: str) -> int:
    if group == "namespaces":
        return -1
    return LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``): each item goes
    in its work group, the longest groups first; a plain ``pytest`` keeps its order."""
    if getattr(config.option, "dist", "no") != "loadgroup":
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_work_group(item)))
    items.sort(key=lambda item: _start_rank(_work_group(item)))  # stable: modules stay whole
