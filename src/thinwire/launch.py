"""Run functions on N local processes joined by gloo on 127.0.0.1 (demos, tests, benches).

    with LocalPool(4) as pool:                 # 4 processes, started once
        a = pool.run(train, "dgc")             # train(rank, 4, "dgc") on every rank
        b = pool.run(train, "powersgd")
    results = run_local(train, 4, args=("dgc",))   # a pool for one job

Each process initialises ``torch.distributed`` (gloo on a free port, one thread), then runs
the jobs it is given: ``fn(rank, world_size, *args)``, whose return value must be picklable
(numbers, lists, numpy arrays; not tensors). A job that raises on any rank, or exceeds its
timeout, raises here with the failing rank's traceback, and the pool is shut down (a
broken process group is not reused). On Linux the processes are forked from a
``forkserver`` that has imported torch once (a rank then starts on a few tens of
milliseconds of CPU instead of the seconds ``import torch`` takes); elsewhere they are
spawned. Either way ``fn`` must be importable (defined at module level), and each rank gets
the environment of the moment the pool was made. On real machines use ``torchrun``.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing
import os
import pickle
import queue
import random
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from thinwire.cluster.tun import enter_namespace

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

if TYPE_CHECKING:
    from thinwire.cluster.emulated import EmulatedCluster


#: the lowest port :func:`free_port` picks (below it: ports services commonly listen on)
LOWEST_PICKED_PORT = 20000
#: the OS's randomness, not the seeded ``random``: two processes seeded alike (two test
#: workers, two jobs) must not pick the same ports in turn
_PORT_CHOICE = random.SystemRandom()


def _ephemeral_start() -> int:
    """The first port the kernel hands out to outgoing connections (Linux's
    ``ip_local_port_range``; 32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


#: what the forkserver imports once, before it forks any rank
_PRELOADED = ["torch", "torch.distributed", "thinwire.launch"]


def process_context() -> Any:
    """The multiprocessing context pools start their ranks with: ``forkserver`` on Linux,
    preloaded with torch (the server is started once per process, on first use, and forks
    each rank from there), ``spawn`` elsewhere. ``THINWIRE_START_METHOD=spawn`` forces
    spawn (to compare, or where a preloaded torch misbehaves). ``THINWIRE_PRELOAD``: more
    modules, comma-separated, for the server to import too (say
    ``transformers.models.llama.modeling_llama`` where every rank builds a Hugging Face
    model: each then skips seconds of imports); one that is not installed is skipped."""
    wanted = os.environ.get("THINWIRE_START_METHOD", "")
    if wanted not in ("", "spawn", "forkserver"):
        raise ValueError(
            f"THINWIRE_START_METHOD={wanted!r} is not a start method pools use: "
            "set it to 'spawn' or 'forkserver', or unset it"
        )
    linux = sys.platform.startswith("linux")
    if wanted == "spawn" or (wanted == "" and not linux):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    extra = [name.strip() for name in os.environ.get("THINWIRE_PRELOAD", "").split(",")]
    ctx.set_forkserver_preload(_PRELOADED + [n for n in extra if n])  # once the server runs: none
    _start_forkserver_quietly()
    return ctx


def _start_forkserver_quietly() -> None:
    """Start the forkserver (once) with c10's C++ log at ERROR unless the user chose a
    level: torch reads ``TORCH_CPP_LOG_LEVEL`` when it is imported, which for every rank
    is now in the server, and c10d warns on each connection to an emulated host (its
    198.18.0.x address has no host name). Errors still print; set the variable to see
    warnings."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        forkserver.ensure_running()
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        forkserver.ensure_running()
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def namespace_port() -> int:
    """A port for a rendezvous inside emulated hosts' namespaces: at random between
    :data:`LOWEST_PICKED_PORT` and the kernel's ephemeral range, where no outgoing
    connection is given one."""
    return _PORT_CHOICE.randrange(
        LOWEST_PICKED_PORT, max(LOWEST_PICKED_PORT + 1, _ephemeral_start())
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, picked at random below
    the kernel's ephemeral range: a port asked of the kernel (port 0) lies in that range,
    where another job's outgoing connections (gloo opens many) may take it between this
    call and the rendezvous binding it ("address already in use")."""
    top = _ephemeral_start()
    if top <= LOWEST_PICKED_PORT + 100:  # an unusual range: let the kernel choose
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    for _ in range(100):
        port = _PORT_CHOICE.randrange(LOWEST_PICKED_PORT, top)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(
        f"no free TCP port found in {LOWEST_PICKED_PORT}-{top - 1} after 100 tries; "
        "free some, or set MASTER_PORT yourself"
    )


def init_local_group(
    rank: int, world_size: int, port: int, timeout_s: float = 60.0, host: str = "127.0.0.1"
) -> None:
    """Join a gloo process group of ``world_size`` processes at ``host:port``."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


@dataclass(frozen=True)
class Placement:
    """Where each rank runs: rank i in network namespace ``namespaces[i]`` (a name, or a
    namespace file's path) with interface ``interface``; the rendezvous is at
    ``master_address`` (an emulated cluster's host 0, or 127.0.0.1 on a private loopback)."""

    namespaces: tuple[str, ...]
    master_address: str
    interface: str

    @staticmethod
    def on(cluster: EmulatedCluster) -> Placement:
        """``cluster.ranks_per_host`` ranks on each host of ``cluster``, in torchrun's order
        (the ranks of a host share its namespace and talk over its loopback)."""
        return Placement(
            tuple(h.namespace for h in cluster.hosts for _ in range(cluster.ranks_per_host)),
            cluster.master_address,
            cluster.hosts[0].interface,
        )

    def local_env(self, rank: int) -> dict[str, str]:
        """torchrun's variables for ``rank``: its host's other ranks are those that share
        its namespace (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``)."""
        namespace = self.namespaces[rank]
        hosts = list(dict.fromkeys(self.namespaces))
        peers = [r for r, n in enumerate(self.namespaces) if n == namespace]
        return {
            "LOCAL_RANK": str(peers.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(peers)),
            "GROUP_RANK": str(hosts.index(namespace)),
        }


def die_with_parent() -> None:
    """Have the kernel kill this process when the process that started it dies (Linux's
    ``PR_SET_PDEATHSIG``), however that dies (even by SIGKILL, which runs no cleanup): a
    worker must never outlive its pool and train on alone. A thread also watches the
    process that asked for this one (a forkserver's clients are not the OS parent) and
    ends this process when it ends. A no-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # the process that asked for this one: under forkserver not the OS parent, which is the
    # server. The server exits when its last client dies, but only after its interpreter
    # has wound down (torch and what else it preloaded): a loaded machine saw a rank
    # outlive its killed pool maker by more than 10 s. So also watch the pool maker.
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    if not parent.is_alive():  # it died before we asked
        os._exit(1)
    threading.Thread(
        target=_exit_when_gone, args=(parent,), name="thinwire-parent-watch", daemon=True
    ).start()


def _exit_when_gone(parent: Any) -> None:
    """Wait for ``parent`` to end (its sentinel closes, whatever killed it); then end this
    process at once: nothing it still computes has anyone to report to."""
    parent.join()
    os._exit(1)


def _serve(
    environment: dict[str, str],
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    jobs: Any,
    results: Any,
    placement: Placement | None = None,
) -> None:
    # a forked rank holds the server's environment: take the pool maker's
    os.environ.clear()
    os.environ.update(environment)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    die_with_parent()
    host = "127.0.0.1"
    try:
        if placement is not None:
            enter_namespace(placement.namespaces[rank])
            os.environ["GLOO_SOCKET_IFNAME"] = placement.interface
            os.environ.update(placement.local_env(rank))
            host = placement.master_address
        init_local_group(rank, world_size, port, timeout_s, host=host)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    try:
        while (job := jobs.get()) is not None:
            fn, args = job
            try:
                results.put((rank, True, fn(rank, world_size, *args)))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class LocalPool:
    """``world_size`` local processes in one gloo process group, reused across jobs.

    Args:
        world_size: number of processes (ranks).
        collective_timeout_s: the process group's timeout: a collective that waits longer
            (a peer died) raises on the ranks still alive.
        placement: run rank i on host i of an emulated cluster (default: all on loopback).
    """

    def __init__(
        self,
        world_size: int,
        collective_timeout_s: float = 60.0,
        placement: Placement | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if placement is not None and len(placement.namespaces) != world_size:
            raise ValueError(
                f"world_size {world_size} does not match the {len(placement.namespaces)} "
                "hosts of the placement: run one rank per host"
            )
        self.world_size = world_size
        ctx = process_context()
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        # A namespace has no listeners of its own, but its ranks' outgoing connections
        # (a rank retrying the store, the previous pool's gloo pairs) take ephemeral ports
        # there: pick below that range, as free_port does (one of a sweep's 35 plans failed
        # with "address already in use" at a port inside it).
        port = free_port() if placement is None else namespace_port()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(
                    dict(os.environ),
                    rank,
                    world_size,
                    port,
                    collective_timeout_s,
                    self._jobs[rank],
                    self._results,
                    placement,
                ),
                daemon=True,
                name=f"thinwire-rank{rank}",
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self.closed = False

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = 300.0,
        while_waiting: Callable[[], None] | None = None,
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; return the results by rank.

        ``while_waiting`` is called about twice a second until the results are in (to
        update a progress display)."""
        if self.closed:
            raise RuntimeError("this LocalPool was shut down (after a failure); make a new one")
        _check_sendable(fn, args)
        for jobs in self._jobs:
            jobs.put((fn, args))
        collected: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(collected) < self.world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"{fn.__name__} did not finish on {self.world_size} local processes "
                        f"within {timeout:.0f} s (ranks done: {sorted(collected)})"
                    )
                try:
                    rank, ok, value = self._results.get(timeout=min(remaining, 0.5))
                except queue.Empty:
                    self._check_alive(collected)
                    if while_waiting is not None:
                        while_waiting()
                    continue
                if not ok:
                    raise RuntimeError(f"rank {rank} failed in {fn.__name__}:\n{value}")
                collected[rank] = value
        except BaseException:
            self.close(force=True)
            raise
        return [collected[rank] for rank in range(self.world_size)]

    def _check_alive(self, collected: dict[int, Any]) -> None:
        for rank, proc in enumerate(self._procs):
            if rank not in collected and not proc.is_alive():
                raise RuntimeError(
                    f"rank {rank} exited with code {proc.exitcode} without a result "
                    "(killed, out of memory, or crashed in C++)"
                )

    def close(self, force: bool = False) -> None:
        """Stop the processes: politely (finish, leave the group) unless ``force``."""
        if self.closed:
            return
        self.closed = True
        if not force:
            for jobs in self._jobs:
                jobs.put(None)
        for proc in self._procs:
            proc.join(timeout=0.1 if force else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)


def _check_sendable(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Refuse, here and now, a job the ranks cannot receive: the job queue pickles in a
    background thread that only prints its error, and the ranks would wait for the job
    until the timeout."""
    try:
        ForkingPickler.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"{name} or its arguments cannot be sent to the ranks ({error}): pass a function "
            "defined at module level (not a lambda or a function inside another) and "
            "arguments that pickle"
        ) from error


def run_local(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...] = (),
    timeout: float = 600.0,
    collective_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` once on ``nprocs`` fresh processes."""
    with LocalPool(nprocs, collective_timeout_s) as pool:
        return pool.run(fn, *args, timeout=timeout)
