"""A private loopback: a network namespace of a run's own, with nothing in it but ``lo``.

On the machine's loopback every process shares one ``lo``, so its kernel byte counters
count whatever else crosses it at the same time (another benchmark, a test, a database).
:func:`private_loopback` gives a run's ranks a ``lo`` of their own. It starts a holder,
``sleep`` run by ``unshare --net`` in a fresh network namespace with ``lo`` brought up,
opens that namespace (``/proc/<holder>/ns/net``) and yields the path of the open
descriptor, which ranks join with :func:`~thinwire.cluster.tun.enter_namespace`; the
descriptor keeps the namespace alive and the path valid whatever becomes of the holder.

The namespace is anonymous: no name under ``/var/run/netns``, no address beyond
127.0.0.1, no link to any other namespace. The kernel frees it when the last process in
it and the last descriptor to it are gone. The holder is stopped on exit, and it dies
with its parent however that dies (``setpriv --pdeathsig KILL``, even on SIGKILL; it
checks that its parent is still the one that started it, in case that died first), so
nothing can be left behind. Creating a network namespace needs ``CAP_SYS_ADMIN`` (root,
outside a container that drops it); :func:`check_private_loopback` says why it cannot
be done.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

_SBIN_PATH = "/usr/sbin:/sbin"
_CAP_SYS_ADMIN = 21  # from <linux/capability.h>
#: what the holder runs inside the new namespace: make sure its parent is the one that
#: started it, bring ``lo`` up, say so, then wait
_HOLDER_SCRIPT = (
    '[ "$PPID" = "{parent}" ] || exit 3; ip link set lo up && echo up && exec sleep infinity'
)


def check_private_loopback() -> str | None:
    """``None`` if this process can make a private loopback, else the reason it cannot."""
    if sys.platform != "linux":
        return "a private loopback needs Linux network namespaces"
    if not _has_capability(_CAP_SYS_ADMIN):
        return (
            "a private loopback needs CAP_SYS_ADMIN to create a network namespace (run as "
            "root; in a container, --cap-add SYS_ADMIN)"
        )
    search = f"{os.environ.get('PATH', '')}:{_SBIN_PATH}"
    for tool, package in (("unshare", "util-linux"), ("setpriv", "util-linux"), ("ip", "iproute2")):
        if shutil.which(tool, path=search) is None:
            return f"the '{tool}' command is missing: apt-get install {package}"
    return None


def _has_capability(bit: int) -> bool:
    """Whether this process's effective capabilities include ``bit``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError):
        pass
    return False


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
    script = _HOLDER_SCRIPT.format(parent=os.getpid())
    holder = subprocess.Popen(
        ["setpriv", "--pdeathsig", "KILL", "unshare", "--net", "--", "sh", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    descriptor = None
    try:
        _wait_until_up(holder, timeout_s)
        descriptor = os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        yield f"/proc/{os.getpid()}/fd/{descriptor}"
    finally:
        if descriptor is not None:
            os.close(descriptor)
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
    if line == b"up" and holder.poll() is None:
        return
    holder.kill()
    holder.wait()
    error = holder.stderr.read().decode(errors="replace").strip()
    raise RuntimeError(
        "could not create a private loopback network namespace "
        f"(`setpriv --pdeathsig KILL unshare --net sh -c ...`): "
        f"{error or f'no answer within {timeout_s:g} s'}; check that this process may "
        "create network namespaces (`unshare --net true`; in a container, --cap-add "
        "SYS_ADMIN)"
    )
