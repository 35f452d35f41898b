"""Ranks on the emulated hosts: each host runs ``ranks_per_host`` processes, which share its
namespace and talk to each other over its loopback (the fast link inside a machine: the
kernel delivers traffic to the host's own address locally, past the shaped device), and to
other hosts' ranks over the emulated link. Ranks are numbered as torchrun numbers them:
rank ``host * ranks_per_host + local_rank``.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from thinwire.cluster.emulated import EmulatedCluster, Host

MAX_RANKS_PER_HOST = 64


def check_ranks_per_host(value: Any) -> int:
    """``value`` if it is a valid number of ranks per host, else an error saying so."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= MAX_RANKS_PER_HOST
    ):
        raise ValueError(
            f"ranks_per_host must be an integer from 1 to {MAX_RANKS_PER_HOST}, got {value!r}"
        )
    return value


def rank_env(
    cluster: EmulatedCluster,
    host: Host,
    local_rank: int,
    port: int,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment ``torchrun`` would give local rank ``local_rank`` of ``host``."""
    per_host = cluster.ranks_per_host
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(host.rank * per_host + local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(len(cluster.hosts) * per_host),
        LOCAL_WORLD_SIZE=str(per_host),
        GROUP_RANK=str(host.rank),
        ROLE_RANK=str(host.rank * per_host + local_rank),
        MASTER_ADDR=cluster.master_address,
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME=host.interface,
        NCCL_SOCKET_IFNAME=host.interface,
        THINWIRE_CLUSTER=cluster.tag,
    )
    return env


def run_ranks(
    cluster: EmulatedCluster,
    command: Sequence[str],
    port: int = 29500,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> list[int]:
    """Run ``command`` as every rank of every host; return the exit codes by rank. If any
    process fails, the others are given a few seconds, then stopped."""
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", host.namespace, *command],
            env=rank_env(cluster, host, local, port, env),
        )
        for host in cluster.hosts
        for local in range(cluster.ranks_per_host)
    ]
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = any(p.returncode not in (None, 0) for p in procs)
            late = deadline is not None and time.monotonic() > deadline
            if failed or late:
                stop_all(procs, grace=5.0 if failed else 0.0)
                break
            time.sleep(0.1)
    except BaseException:
        stop_all(procs, grace=0.0)
        raise
    return [p.wait() for p in procs]


def stop_all(procs: Sequence[subprocess.Popen[Any]], grace: float) -> None:
    """Give ``procs`` ``grace`` seconds to finish, then terminate them (and kill what is
    still running 5 s later)."""
    deadline = time.monotonic() + grace
    while grace and time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
