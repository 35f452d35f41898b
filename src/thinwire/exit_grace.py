"""A moment at the interpreter's exit for PyTorch's gloo worker threads.

A gloo process group runs its collectives on worker threads (``pt_gloo_runloop``). When a
collective is done, the thread that ran it drops its last reference to the collective's
tensors a moment later, and where a tensor has a Python object that drop takes the GIL.
If the main thread has reached the interpreter's finalisation by then (the program's last
collective finished just before it ended, and a group is still referenced, by a device
mesh or a trainer, so ``destroy_process_group()`` did not join its threads), taking the
GIL ends the worker thread inside a destructor, and the process aborts: SIGABRT,
"terminate called without an active exception", after the program did all its work.
Measured: two ranks that end right after a collective on each of eight groups aborted in
6 of 10 runs; the hybrid quick start in about 1 of 8.

So at exit, where gloo worker threads are alive, thinwire sleeps :data:`EXIT_GRACE_S`
with the GIL released: a worker thread waiting for it finishes its drop while the
interpreter is whole. Registered when ``thinwire`` is imported, so it runs after the
program's own exit handlers. Linux only (the threads are found by name in ``/proc``);
elsewhere it does nothing.
"""

from __future__ import annotations

import atexit
import os
import time

#: how long the exit waits, GIL released, when gloo worker threads are alive (s)
EXIT_GRACE_S = 0.2
#: the thread name PyTorch gives a gloo process group's workers
GLOO_WORKER = "pt_gloo_runloop"


def gloo_workers_alive(tasks: str = "/proc/self/task") -> bool:
    """Whether this process has a live gloo worker thread (False where ``tasks`` cannot
    be read)."""
    try:
        ids = os.listdir(tasks)
    except OSError:
        return False
    for thread in ids:
        try:
            with open(os.path.join(tasks, thread, "comm")) as name:
                if name.read().strip() == GLOO_WORKER:
                    return True
        except OSError:  # the thread ended meanwhile
            continue
    return False


@atexit.register
def let_gloo_workers_finish() -> None:
    """At exit: sleep :data:`EXIT_GRACE_S` if gloo worker threads are alive."""
    if gloo_workers_alive():
        time.sleep(EXIT_GRACE_S)
