"""The private loopback: a namespace of a run's own, whose ``lo`` counts only its traffic,
and which goes when its owner goes, also when the owner is killed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from thinwire.cluster.private import check_private_loopback, private_loopback

REASON = check_private_loopback()
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


@needs_root
def test_its_lo_counts_what_is_sent_inside_and_nothing_from_outside() -> None:
    with private_loopback() as namespace:
        counted: list[int] = []
        inside = threading.Thread(target=lambda: counted.append(_send_inside(namespace, 0)))
        inside.start()  # counts lo while the machine's loopback carries megabytes
        blasted = _blast_machine_loopback(0.5)
        inside.join()
        assert blasted > 10_000_000
        assert counted[0] < 20_000  # its own handshake only, none of the blast
        assert 4_000_000 <= _send_inside(namespace, 4_000_000) < 4_400_000


@needs_root
def test_it_is_gone_when_the_block_ends() -> None:
    with private_loopback() as namespace:
        holder = int(namespace.split("/")[2])
        assert os.path.exists(namespace)
    assert not os.path.exists(namespace)
    assert not os.path.exists(f"/proc/{holder}")


@needs_root
def test_its_holder_dies_with_a_killed_owner() -> None:
    script = (
        "import os, signal\n"
        "from thinwire.cluster.private import private_loopback\n"
        "with private_loopback() as namespace:\n"
        "    print(namespace, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    namespace = done.stdout.strip()
    deadline = time.monotonic() + 10
    while os.path.exists(namespace) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(namespace)


def test_without_root_it_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in (check_private_loopback() or "")
    with pytest.raises(RuntimeError, match="needs root"), private_loopback():
        pass
