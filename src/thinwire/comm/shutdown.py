"""Closing thinwire's threads before the process groups they use go away.

thinwire runs collectives on threads of its own (each engine's exchange thread, a
parameter server's shard). A thread still inside a collective when its process group is
destroyed, by ``torch.distributed.destroy_process_group()`` or by the interpreter's exit,
can abort the process (SIGABRT, "terminate called without an active exception") instead
of letting it end with its own exit code. So every such thread registers here, and is
closed, in the order it was started, at three moments:

* when its owner is closed (``engine.close()``, ``ps.close()``);
* when ``torch.distributed.destroy_process_group()`` destroys the default group (every
  thread) or the thread's own group: PyTorch offers no hook for this, so thinwire wraps
  that function once, at its first thread (``dist.destroy_process_group`` then closes
  thinwire's threads and calls PyTorch's; the original stays at ``__wrapped__``; a name
  imported before thinwire started its first thread is not wrapped);
* at interpreter exit (:mod:`atexit`).

Each close waits at most :data:`CLOSE_WAIT_S` for work under way: a collective that a dead
peer never completes must not hold the exit (or the destroy) for the group's whole timeout.
"""

from __future__ import annotations

import atexit
import functools
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

#: how long a close at exit or at a group's destruction waits for work under way
CLOSE_WAIT_S = 10.0


class Closable(Protocol):
    """A thread's owner: closes it, waiting at most ``timeout`` s for work under way."""

    def close_for_shutdown(self, timeout: float) -> None: ...


_lock = threading.Lock()
#: live owners in the order they registered, with the group each one uses (None: default)
_live: dict[int, tuple[weakref.ref[Any], Any]] = {}
_order = 0


def register(owner: Closable, group: Any = None) -> None:
    """Close ``owner`` (held weakly) at exit and when ``group`` (or the default group) is
    destroyed; install the wrapper of ``destroy_process_group`` if it is not yet."""
    global _order
    _install()
    with _lock:
        _order += 1
        _live[_order] = (weakref.ref(owner), group)
        owner._shutdown_key = _order  # type: ignore[attr-defined]


def unregister(owner: Any) -> None:
    """``owner`` was closed by its own hand: forget it."""
    key = getattr(owner, "_shutdown_key", None)
    with _lock:
        _live.pop(key, None)


def close_all(group: Any = None, timeout: float = CLOSE_WAIT_S) -> None:
    """Close every live owner of ``group``'s threads (every owner when ``group`` is None
    or the default group), oldest first. A failing close is reported as a warning: the
    caller is tearing down and must go on."""
    everything = group is None or group is dist.GroupMember.WORLD
    with _lock:
        chosen = [
            (key, ref)
            for key, (ref, owned) in sorted(_live.items())
            if everything or owned is group
        ]
        for key, _ in chosen:
            _live.pop(key, None)
    for _, ref in chosen:
        owner = ref()
        if owner is None:
            continue
        try:
            owner.close_for_shutdown(timeout)
        except Exception as error:  # tearing down: report it, do not stop
            warnings.warn(
                f"thinwire: closing {type(owner).__name__} at shutdown failed: {error}",
                RuntimeWarning,
                stacklevel=2,
            )


def _install() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` (once) so that it closes
    thinwire's threads of the group first."""
    current = dist.destroy_process_group
    if getattr(current, "_thinwire", False):
        return
    wrapped = _closing_first(current)
    dist.destroy_process_group = wrapped
    c10d.destroy_process_group = wrapped


def _closing_first(destroy: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None) -> Any:
        """PyTorch's ``destroy_process_group``, after closing thinwire's threads that use
        ``group`` (all of them for the default group): see :mod:`thinwire.comm.shutdown`."""
        close_all(group)
        return destroy(group)

    destroy_process_group._thinwire = True  # type: ignore[attr-defined]
    return destroy_process_group


@atexit.register
def _close_at_exit() -> None:
    close_all(None)
