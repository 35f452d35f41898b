"""One profile at a time on a machine: a second process waits for the first's lock, and a
process the holder starts does not wait for it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from thinwire.errors import ThinwireError
from thinwire.plan.profile_lock import HELD_ENV, LOCK_ENV, profiling_alone

pytestmark = pytest.mark.timeout(60)

#: a process that takes the lock, then writes "in" and exits
TAKE_LOCK = (
    "from thinwire.plan.profile_lock import profiling_alone\n"
    "with profiling_alone():\n"
    "    print('in', flush=True)\n"
)


def start_unrelated_taker(lock) -> subprocess.Popen:
    """A process that is not the holder's child (it does not inherit the hold)."""
    env = {key: value for key, value in os.environ.items() if key != HELD_ENV}
    env[LOCK_ENV] = str(lock)
    return subprocess.Popen(
        [sys.executable, "-c", TAKE_LOCK], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_a_second_process_waits_for_the_holder_and_says_so(tmp_path, monkeypatch):
    lock = tmp_path / "profile.lock"
    monkeypatch.delenv(HELD_ENV, raising=False)
    with profiling_alone(lock):
        taker = start_unrelated_taker(lock)
        deadline = time.monotonic() + 30
        while "waiting" not in (line := taker.stderr.readline()):
            assert line and time.monotonic() < deadline, "the second process did not wait"
        assert taker.poll() is None, "the second process ran while the lock was held"
    out, _ = taker.communicate(timeout=30)
    assert taker.returncode == 0 and out.strip() == "in"
    assert HELD_ENV not in os.environ


def test_a_process_the_holder_starts_does_not_wait_for_it(tmp_path, monkeypatch):
    lock = tmp_path / "profile.lock"
    monkeypatch.delenv(HELD_ENV, raising=False)
    with profiling_alone(lock):
        assert os.environ[HELD_ENV] == "1"
        done = subprocess.run(
            [sys.executable, "-c", TAKE_LOCK], env={**os.environ, LOCK_ENV: str(lock)},
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "in"
    assert "waiting" not in done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_another_users_lock_file_is_taken_not_an_error():
    """Root made the lock file (mode 0644); another user's profile opens it and locks it
    (a forked child that drops to ``nobody``: it needs no interpreter of its own)."""
    shared = Path(tempfile.mkdtemp(prefix="thinwire-lock-test-"))
    try:
        shared.chmod(0o1777)
        lock = shared / "profile.lock"
        with profiling_alone(lock):
            pass
        assert lock.stat().st_uid == 0
        child = os.fork()
        if child == 0:  # the child: drop to nobody, take the lock, report by exit code
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                os.environ.pop(HELD_ENV, None)
                with profiling_alone(lock):
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "another user could not take the lock"
    finally:
        shutil.rmtree(shared)


@pytest.mark.parametrize("where", ["missing folder", "a folder"])
def test_a_lock_path_that_cannot_be_opened_names_it_and_the_variable(tmp_path, monkeypatch, where):
    lock = tmp_path / "no-such-folder" / "profile.lock" if where == "missing folder" else tmp_path
    monkeypatch.delenv(HELD_ENV, raising=False)
    with pytest.raises(ThinwireError, match=LOCK_ENV) as raised, profiling_alone(lock):
        pytest.fail("the block ran without the lock")
    assert str(lock) in str(raised.value)
    assert HELD_ENV not in os.environ
