"""A private loopback: a network namespace of a run's own, with nothing in it but ``lo``.

On the machine's loopback every process shares one ``lo``, so its kernel byte counters
count whatever else crosses it at the same time (another benchmark, a test, a database).
:func:`private_loopback` gives a run's ranks a ``lo`` of their own. It starts a holder,
``sleep`` run by ``unshare --net`` in a fresh network namespace with ``lo`` brought up,
and yields that namespace as ``/proc/<holder>/ns/net``, which ranks join with
:func:`~thinwire.cluster.tun.enter_namespace`.

The namespace is anonymous: no name under ``/var/run/netns``, no address beyond
127.0.0.1, no link to any other namespace. The kernel frees it when the last process in
it has gone. The holder is stopped on exit, and it dies with its parent however that
dies (even by SIGKILL), so nothing can be left behind. Creating a network namespace
needs root (``CAP_SYS_ADMIN``); :func:`check_private_loopback` says why it cannot be done.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_SBIN_PATH = "/usr/sbin:/sbin"
#: what the holder runs inside the new namespace: bring ``lo`` up, say so, then wait
_HOLDER_SCRIPT = "ip link set lo up && echo up && exec sleep infinity"


def check_private_loopback() -> str | None:
    """``None`` if this process can make a private loopback, else the reason it cannot."""
    if sys.platform != "linux":
        return "a private loopback needs Linux network namespaces"
    if os.geteuid() != 0:
        return "a private loopback needs root (it creates a network namespace)"
    search = f"{os.environ.get('PATH', '')}:{_SBIN_PATH}"
    for tool in ("unshare", "ip"):
        if shutil.which(tool, path=search) is None:
            package = "util-linux" if tool == "unshare" else "iproute2"
            return f"the '{tool}' command is missing: apt-get install {package}"
    return None


def _die_with_parent() -> None:
    """In the holder, between fork and exec: the kernel kills it when its parent dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@contextlib.contextmanager
def private_loopback(timeout_s: float = 10.0) -> Iterator[str]:
    """A fresh network namespace whose only interface is ``lo`` (up), for as long as the
    ``with`` block runs; yields the path ranks pass to ``enter_namespace``.

    Raises:
        RuntimeError: this process cannot create one (see :func:`check_private_loopback`),
            or the holder failed to start within ``timeout_s`` seconds.
    """
    reason = check_private_loopback()
    if reason:
        raise RuntimeError(reason)
    env = {**os.environ, "PATH": f"{os.environ.get('PATH', '')}:{_SBIN_PATH}"}
    holder = subprocess.Popen(
        ["unshare", "--net", "--", "sh", "-c", _HOLDER_SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        preexec_fn=_die_with_parent,
    )
    try:
        _wait_until_up(holder, timeout_s)
        yield f"/proc/{holder.pid}/ns/net"
    finally:
        holder.kill()
        holder.wait()
        for stream in (holder.stdout, holder.stderr):
            if stream is not None:
                stream.close()


def _wait_until_up(holder: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Return once the holder has said ``up``; raise with its error if it never does."""
    assert holder.stdout is not None and holder.stderr is not None
    with selectors.DefaultSelector() as selector:
        selector.register(holder.stdout, selectors.EVENT_READ)
        ready = selector.select(timeout_s)
    line = holder.stdout.readline().strip() if ready else b""
    if line == b"up":
        return
    holder.kill()
    holder.wait()
    error = holder.stderr.read().decode(errors="replace").strip()
    raise RuntimeError(
        "could not create a private loopback network namespace "
        f"(`unshare --net sh -c '{_HOLDER_SCRIPT}'`): "
        f"{error or f'no answer within {timeout_s:g} s'}; check that this kernel allows "
        "network namespaces (`unshare --net true` as root)"
    )
