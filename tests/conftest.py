"""Shared fixtures: process pools spawned once per test module."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from thinwire.launch import LocalPool

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _pool(world_size: int) -> Iterator[LocalPool]:
    pool = LocalPool(world_size, collective_timeout_s=60)
    try:
        yield pool
    finally:
        pool.close(force=pool.closed)


@pytest.fixture(scope="module")
def pool2() -> Iterator[LocalPool]:
    """Two gloo ranks on 127.0.0.1, shared by the tests of one module."""
    yield from _pool(2)


@pytest.fixture(scope="module")
def pool4() -> Iterator[LocalPool]:
    """Four gloo ranks on 127.0.0.1, shared by the tests of one module."""
    yield from _pool(4)


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def pool(request: pytest.FixtureRequest) -> LocalPool:
    """Each test that asks for ``pool`` runs on 2 and on 4 ranks."""
    return request.getfixturevalue(f"pool{request.param}")
