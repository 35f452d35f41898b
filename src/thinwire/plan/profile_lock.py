"""One profile at a time on a machine.

A profile times a model's parts on a core of their own (:mod:`thinwire.plan.stage_profile`).
Two thinwire processes profiling at once on one machine (two benches side by side, two
ranks of a host planning at once) would each time the other's load into their compute,
and a sleeping bench sleeps what it profiled. So profiles take an exclusive lock on a file
shared by every thinwire process of the machine (``fcntl.flock``: released by the kernel
when its holder exits, however it exits) and wait their turn, saying so once. The fresh
processes a holder starts inherit its hold (:data:`HELD_ENV`), so a profile within a
profile does not wait for itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from thinwire.errors import ThinwireError

#: the environment variable that moves the lock file (default: the temporary directory)
LOCK_ENV = "THINWIRE_PROFILE_LOCK"
#: set while this process holds the lock; its children see it and do not wait for it
HELD_ENV = "THINWIRE_PROFILE_LOCK_HELD"


def lock_path() -> Path:
    """The machine's profile lock file: ``$THINWIRE_PROFILE_LOCK``, or
    ``thinwire-profile.lock`` in the temporary directory."""
    return Path(os.environ.get(LOCK_ENV) or Path(tempfile.gettempdir()) / "thinwire-profile.lock")


def _open_shared(path: Path) -> BinaryIO:
    """``path`` opened for reading, created first if missing: ``flock`` needs no more, and
    another user's lock file (created by root, mode 0644) opens read-only where it would
    not open for writing. A path that cannot be opened (a missing folder, a folder, no
    permission) raises a :class:`~thinwire.errors.ThinwireError` naming it and :data:`LOCK_ENV`."""
    try:
        try:
            return open(path, "rb")
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return open(path, "rb")
    except OSError as error:
        raise ThinwireError(
            f"cannot open the profile lock file {path}: {error.strerror or error}. Set "
            f"{LOCK_ENV} to a file in a folder this user can write (for example "
            f"{LOCK_ENV}=$HOME/.thinwire-profile.lock); every thinwire process on the machine "
            f"must name the same file for profiles to wait for each other"
        ) from error


@contextlib.contextmanager
def profiling_alone(path: Path | None = None) -> Iterator[None]:
    """Hold the machine's profile lock (``path``, default :func:`lock_path`) for the block;
    if another process holds it, say so on stderr and wait for it. Within a holder (or a
    process it started) the block runs at once."""
    if os.environ.get(HELD_ENV):
        yield
        return
    path = Path(path or lock_path())
    with _open_shared(path) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"thinwire: another process is profiling on this machine; waiting for it "
                f"(lock {path})",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        os.environ[HELD_ENV] = "1"
        try:
            yield
        finally:
            del os.environ[HELD_ENV]
            fcntl.flock(handle, fcntl.LOCK_UN)
