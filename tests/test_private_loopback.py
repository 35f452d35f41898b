"""The private loopback: a namespace of a run's own, whose ``lo`` counts only its traffic,
and which goes when its owner goes, also when the owner is killed."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from thinwire.cluster.private import check_private_loopback, private_loopback

REASON = check_private_loopback() or (None if shutil.which("nsenter") else "no nsenter")
needs_root = pytest.mark.skipif(REASON is not None, reason=f"private loopback: {REASON}")
pytestmark = [pytest.mark.timeout(60)]

#: run inside a namespace: send ``argv[1]`` bytes over its 127.0.0.1, print lo's sent count
_SEND_AND_COUNT = """
import socket, sys, threading
def sent():
    for line in open("/proc/net/dev").read().splitlines()[2:]:
        name, fields = line.split(":", 1)
        if name.strip() == "lo":
            return int(fields.split()[8])
before = sent()
server = socket.create_server(("127.0.0.1", 0))
def drain():
    peer, _ = server.accept()
    while peer.recv(1 << 20):
        pass
reader = threading.Thread(target=drain)
reader.start()
with socket.create_connection(server.getsockname()) as client:
    client.sendall(b"x" * int(sys.argv[1]))
reader.join()
print(sent() - before)
"""


def _blast_machine_loopback(seconds: float) -> int:
    """Send as much as possible over the machine's own 127.0.0.1 for ``seconds``."""
    server = socket.create_server(("127.0.0.1", 0))

    def drain() -> None:
        peer, _ = server.accept()
        with peer:
            while peer.recv(1 << 20):
                pass

    reader = threading.Thread(target=drain)
    reader.start()
    sent = 0
    with socket.create_connection(server.getsockname()) as client:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            client.sendall(b"y" * (1 << 20))
            sent += 1 << 20
    reader.join()
    server.close()
    return sent


def _send_inside(namespace: str, nbytes: int) -> int:
    done = subprocess.run(
        ["nsenter", f"--net={namespace}", sys.executable, "-c", _SEND_AND_COUNT, str(nbytes)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def _lo_sent(namespace: str) -> int:
    """Bytes sent on ``lo`` inside ``namespace``, as its kernel counts them."""
    done = subprocess.run(
        ["nsenter", f"--net={namespace}", "cat", "/proc/net/dev"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    for line in done.stdout.splitlines()[2:]:
        name, fields = line.split(":", 1)
        if name.strip() == "lo":
            return int(fields.split()[8])
    raise AssertionError(f"no lo in {done.stdout!r}")


def _holders(pid: int, patience_s: float = 5.0) -> list[int]:
    """The children of ``pid`` that are a private loopback's holder (``sleep infinity``, or
    the ``setpriv``/``unshare``/``sh`` it is still on its way from: one process); a process
    has other children too (multiprocessing's resource tracker). A process in the middle
    of an ``exec`` shows an empty command line for a moment (the holder execs ``sleep``
    just after it said it is up), so an empty answer is asked again for ``patience_s``."""
    deadline = time.monotonic() + patience_s
    while True:
        found = _holders_now(pid)
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _holders_now(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                command = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent == pid and b"sleep infinity" in command.replace(b"\x00", b" "):
                found.append(int(entry))
    return found


@needs_root
def test_its_lo_counts_what_is_sent_inside_and_nothing_from_outside() -> None:
    with private_loopback() as namespace:
        before = _lo_sent(namespace)
        blasted = _blast_machine_loopback(0.5)  # megabytes over the machine's loopback
        assert blasted > 10_000_000
        assert _lo_sent(namespace) == before  # none of them
        assert 4_000_000 <= _send_inside(namespace, 4_000_000) < 4_400_000


@needs_root
def test_it_is_gone_when_the_block_ends() -> None:
    with private_loopback() as namespace:
        (holder,) = _holders(os.getpid())
        assert os.path.exists(namespace)
    assert not os.path.exists(namespace)
    assert not os.path.exists(f"/proc/{holder}")


@needs_root
def test_its_holder_dies_with_a_killed_owner() -> None:
    script = (
        "import os, signal, sys\n"
        "from thinwire.cluster.private import private_loopback\n"
        "with private_loopback():\n"
        "    print(os.getpid(), flush=True)\n"
        "    sys.stdin.readline()  # killed once the test has found the holder\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert owner.stdin is not None and owner.stdout is not None
    pid = int(owner.stdout.readline())
    (holder,) = _holders(pid)
    owner.stdin.write("kill\n")
    owner.stdin.flush()
    assert owner.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{holder}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{holder}")


def test_without_the_capability_it_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import thinwire.cluster.private as private

    monkeypatch.setattr(private, "_has_capability", lambda bit: False)
    assert "needs CAP_SYS_ADMIN" in (check_private_loopback() or "")
    with pytest.raises(RuntimeError, match="--cap-add SYS_ADMIN"), private_loopback():
        pass
