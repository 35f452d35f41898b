"""No process outlives the run that started it: SIGTERM to ``thinwire bench`` stops its
workers, and a pool's workers die with their parent even when it is killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _descendants(pid: int) -> set[int]:
    """Every living process below ``pid``, read from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    living = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state != "Z":
            living.add(pid)
    return living


def _wait_for_workers(proc: subprocess.Popen, count: int, timeout: float = 60.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = _descendants(proc.pid)
        if len(workers) >= count:
            return workers
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    pytest.fail(f"fewer than {count} worker processes started within {timeout:.0f} s")


def _gone_within(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_the_bench_stops_its_workers(tmp_path: Path) -> None:
    command = [
        *(sys.executable, "-m", "thinwire.cli", "bench", "--task", "digits", "--workers", "2"),
        *("--network", "loopback", "--steps", "1000000", "--methods", "dense"),
        *("--out", str(tmp_path)),
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    workers = _wait_for_workers(proc, 2)
    time.sleep(2)  # past start-up: training
    proc.send_signal(signal.SIGTERM)
    # bounds for a loaded machine (the whole suite beside it); an orphaned worker would
    # train on for its million steps
    assert proc.wait(timeout=60) != 0
    assert not _gone_within(workers, 30), "workers outlived the bench"


SCRIPT = """
import os, sys, time
from pathlib import Path
from thinwire.launch import LocalPool

def nap(rank, world_size, folder):
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)

if __name__ == "__main__":
    pool = LocalPool(2)
    pool.run(nap, sys.argv[1], timeout=600)
"""

#: a module whose exit takes 30 s: preloaded, it holds the forkserver up after its client
#: died (a server winding down torch on a loaded machine was seen to take over 10 s)
SLOW_EXIT = "import atexit, time\natexit.register(time.sleep, 30)\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
@pytest.mark.parametrize("server", ["prompt", "slow-to-exit"])
def test_pool_workers_die_when_their_parent_is_killed(tmp_path: Path, server: str) -> None:
    """Killed outright, the pool maker runs no cleanup: its ranks die by the kernel's
    parent-death signal when their forkserver exits, and by their own watch of the pool
    maker where the server is slow to exit."""
    script = tmp_path / "pool.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if k != "THINWIRE_PRELOAD"}  # torch only
    if server == "slow-to-exit":
        (tmp_path / "slow_exit.py").write_text(SLOW_EXIT)
        env["THINWIRE_PRELOAD"] = "slow_exit"
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
        assert proc.poll() is None, "the pool script ended early"
        time.sleep(0.2)
    ranks = {int(f.read_text()) for f in tmp_path.glob("rank*.pid")}
    assert len(ranks) == 2, "the ranks did not start within 60 s"
    everyone = _descendants(proc.pid)
    proc.kill()  # SIGKILL: no handler, no cleanup in the parent
    proc.wait(timeout=10)
    assert not _gone_within(ranks, 10), "ranks outlived their killed parent"
    if server == "prompt":
        assert not _gone_within(everyone, 10), "the forkserver outlived its client"


def test_ranks_that_raise_while_exchanging_exit_with_their_error_not_an_abort(
    tmp_path: Path,
) -> None:
    """A rank raising with delayed averaging's corrections in flight exits with Python's
    code 1. Without thinwire closing its exchange threads at exit, both ranks aborted
    (SIGABRT, "terminate called without an active exception") in 10 of 10 runs, so one run
    tells."""
    import json

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "exits.json"
    command = [sys.executable, str(root / "bench" / "exit_on_error.py"), "--runs", "1",
               "--out", str(out)]  # fmt: skip
    subprocess.run(command, check=True, timeout=110, capture_output=True)
    result = json.loads(out.read_text())
    assert result["exit_codes"] == {"1": 2}, result["not_python_exit"]


def test_free_ports_lie_below_the_kernels_ephemeral_range_and_skip_taken_ones(monkeypatch) -> None:
    """Outgoing connections take ports in the ephemeral range, so a port picked there
    could be taken before the rendezvous binds it (it happened with two test processes)."""
    import random
    import socket

    import thinwire.launch as launch

    top = launch._ephemeral_start()
    picked = []
    for _ in range(5):
        random.seed(0)  # a seeded ``random`` does not repeat the picks
        picked.append(launch.free_port())
    assert all(launch.LOWEST_PICKED_PORT <= port < top for port in picked), (picked, top)
    assert len(set(picked)) > 1
    # inside emulated hosts' namespaces too (a sweep's plan once met a taken port above)
    in_namespace = {launch.namespace_port() for _ in range(20)}
    assert all(launch.LOWEST_PICKED_PORT <= port < top for port in in_namespace)
    assert len(in_namespace) > 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", picked[0]))
        taken.listen()
        other = next(port for port in picked if port != picked[0])
        choices = iter([picked[0], other])
        monkeypatch.setattr(launch._PORT_CHOICE, "randrange", lambda low, high: next(choices))
        assert launch.free_port() == other


def _environment_probe(rank: int, world_size: int) -> tuple[str | None, int]:
    import torch

    return os.environ.get("THINWIRE_PROBE_VARIABLE"), torch.get_num_threads()


def test_ranks_take_the_environment_of_the_moment_their_pool_is_made(monkeypatch) -> None:
    """A forked rank starts with the forkserver's environment, which is frozen when the
    server starts: the pool hands each rank its maker's (without it the second pool sees
    what the first saw)."""
    from thinwire.launch import LocalPool, process_context

    if sys.platform.startswith("linux"):
        assert process_context().get_start_method() == "forkserver"
    monkeypatch.setenv("THINWIRE_PROBE_VARIABLE", "first")
    with LocalPool(2) as pool:  # starts the server if this process has none yet
        assert pool.run(_environment_probe) == [("first", 1)] * 2
    monkeypatch.setenv("THINWIRE_PROBE_VARIABLE", "second")
    with LocalPool(2) as pool:
        assert pool.run(_environment_probe) == [("second", 1)] * 2


def test_an_unknown_start_method_is_refused_with_the_ones_there_are(monkeypatch) -> None:
    from thinwire.launch import LocalPool

    monkeypatch.setenv("THINWIRE_START_METHOD", "fork")
    with pytest.raises(ValueError, match="'spawn' or 'forkserver'"):
        LocalPool(2)


def test_a_job_the_ranks_cannot_receive_is_refused_at_once() -> None:
    """The job queue pickles in a background thread that only prints its error: without the
    check a local function left every rank waiting until the timeout."""
    from thinwire.launch import LocalPool

    def local_job(rank: int, world_size: int) -> int:
        return rank

    with LocalPool(1) as pool:
        started = time.monotonic()
        with pytest.raises(TypeError, match="defined at module level"):
            pool.run(local_job, timeout=60)
        assert time.monotonic() - started < 10
        assert pool.run(_environment_probe)[0][1] == 1  # the pool still runs jobs after it
