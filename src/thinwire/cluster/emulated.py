"""An emulated cheap cluster on one machine: N hosts in network namespaces, slow links.

    with EmulatedCluster(hosts=4, bandwidth="100mbit", latency="1ms") as cluster:
        cluster.run(["python", "train.py"])        # each rank of each host, torchrun's env

Each host is a network namespace ``thinwire-<tag>-h<i>`` whose only interface, ``tw0``, is
a TUN device with address ``198.18.0.<i+1>/24`` (a benchmarking range; no other range is
used). The forwarder process (:mod:`thinwire.cluster.forwarder`) holds the devices and is
the switch between them: it delays every packet by the one-way ``latency`` and limits each
host's downlink to ``bandwidth``; a ``tbf`` qdisc on each ``tw0`` limits its uplink. The
MTU follows the rate (about 1 ms of serialisation per packet, 1500 to 65000 bytes), so the
forwarder moves few packets per second at any speed.

Everything the cluster creates is removed on exit, on error and on Ctrl-C: the forwarder
deletes the namespaces when it stops, whoever stops it, and :meth:`EmulatedCluster.up`
first removes what a killed run left behind (namespaces whose forwarder is gone). Needs
root (namespaces, TUN devices, qdiscs); :func:`check_can_emulate` says why not, if not.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thinwire.cluster.faults import fault_order, send_fault
from thinwire.cluster.forwarder import ForwarderConfig
from thinwire.cluster.ranks import check_ranks_per_host, rank_env, run_ranks
from thinwire.cluster.tun import NETNS_DIR
from thinwire.cluster.units import parse_duration, parse_rate
from thinwire.cluster.uplink import check_uplink_queue, tbf_arguments

PREFIX = "thinwire-"
SUBNET = "198.18.0"
INTERFACE = "tw0"
STATE_DIR = Path("/run/thinwire")
MAX_HOSTS = 250

#: per-namespace TCP settings: socket buffers that start at 1 MiB (so one 65000-byte packet
#: is not a whole send buffer) and grow to cover 1 Gbit/s x 100 ms; no IPv6 chatter
TCP_TUNING = (
    ("net.ipv4.tcp_rmem", "4096 1048576 33554432"),
    ("net.ipv4.tcp_wmem", "4096 1048576 33554432"),
    ("net.ipv6.conf.all.disable_ipv6", "1"),
)


class ClusterError(RuntimeError):
    """The emulated cluster could not be built, found or used; the message says why."""


def check_can_emulate() -> str | None:
    """``None`` if this process can build an emulated cluster, else the reason it cannot."""
    if sys.platform != "linux":
        return "the emulated cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return (
            "the emulated cluster needs root (network namespaces, TUN devices, tc); run as "
            "root, or use plain loopback: thinwire bench --network loopback"
        )
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (modprobe tun)"
    for tool in ("ip", "tc"):
        if shutil.which(tool, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin") is None:
            return f"the '{tool}' command is missing: apt-get install iproute2"
    return None


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, address and interface."""

    rank: int
    namespace: str
    address: str
    interface: str = INTERFACE


class EmulatedCluster:
    """N hosts joined by links of one bandwidth and one-way latency (see the module doc).

    Args:
        hosts: number of hosts (1 to 250).
        bandwidth: each host's link rate in each direction, e.g. ``"100mbit"``, or
            ``"unlimited"``.
        latency: one-way delay between any two hosts, e.g. ``"1ms"``.
        tag: a short name for this cluster (default: random); namespaces are
            ``thinwire-<tag>-h<i>``.
        ranks_per_host: processes each host runs (:mod:`thinwire.cluster.ranks`).
        uplink_queue: packets each host's uplink queue holds (default: 10 ms of the
            link; :mod:`thinwire.cluster.uplink` says when to raise it).
    """

    def __init__(
        self,
        hosts: int,
        bandwidth: str | float | None = "1gbit",
        latency: str | float = "0ms",
        tag: str | None = None,
        ranks_per_host: int = 1,
        uplink_queue: int | None = None,
    ) -> None:
        self.ranks_per_host = check_ranks_per_host(ranks_per_host)
        self.uplink_queue = check_uplink_queue(uplink_queue)
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be an integer from 1 to {MAX_HOSTS}, got {hosts!r}")
        self.rate_bps = parse_rate(bandwidth)
        self.latency_s = parse_duration(latency)
        self.bandwidth = bandwidth
        self.latency = latency
        self.tag = tag or secrets.token_hex(2)
        if not re.fullmatch(r"[a-z0-9]{1,6}", self.tag):
            raise ValueError(f"tag must be 1-6 lowercase letters or digits, got {self.tag!r}")
        self.hosts = [
            Host(i, f"{PREFIX}{self.tag}-h{i}", f"{SUBNET}.{i + 1}") for i in range(hosts)
        ]
        self.forwarder: subprocess.Popen[bytes] | None = None
        self.forwarder_pid: int | None = None

    # -- building and tearing down --------------------------------------------------------

    @property
    def mtu(self) -> int:
        """Packet size: about 1 ms of serialisation at the link rate, 1500 to 65000 bytes."""
        if self.rate_bps is None:
            return 65_000
        return int(min(65_000, max(1500, self.rate_bps / 8 * 1e-3)))

    @property
    def port_buffer_bytes(self) -> int:
        """Each switch port's buffer: 20 ms at the link rate, at least 64 KiB."""
        if self.rate_bps is None:
            return 1 << 30
        return int(max(64 * 1024, 4 * self.mtu, self.rate_bps / 8 * 0.02))

    @property
    def master_address(self) -> str:
        """The address of host 0, where the process group's rendezvous listens."""
        return self.hosts[0].address

    def up(self, daemon: bool = False) -> EmulatedCluster:
        """Create the namespaces, start the forwarder, configure every host.

        ``daemon``: the forwarder outlives this process (``thinwire cluster up``) and the
        cluster stays until :meth:`down`; otherwise it goes when this process lets go.
        """
        reason = check_can_emulate()
        if reason:
            raise ClusterError(reason)
        with _cluster_lock():  # no other `up` may see our namespaces before the forwarder
            remove_leftovers()
            taken = [h.namespace for h in self.hosts if h.namespace in list_namespaces()]
            if taken:
                raise ClusterError(
                    f"cluster {self.tag!r} is already up ({', '.join(taken)}); use another "
                    f"--tag, or remove it first: thinwire cluster down --tag {self.tag}"
                )
            created: list[str] = []
            try:
                for host in self.hosts:
                    _ip("netns", "add", host.namespace)
                    created.append(host.namespace)
                self._start_forwarder(daemon)
                for host in self.hosts:
                    self._configure(host)
                self._write_state()
            except BaseException:
                self._stop_forwarder()
                for namespace in created:
                    _ip("netns", "delete", namespace, check=False)
                (STATE_DIR / f"{self.tag}.log").unlink(missing_ok=True)
                raise
        return self

    def _start_forwarder(self, daemon: bool) -> None:
        config = ForwarderConfig(
            devices=[self._device(h) for h in self.hosts],
            addresses=[h.address for h in self.hosts],
            latency_s=self.latency_s,
            rate_bps=self.rate_bps,
            namespaces=[h.namespace for h in self.hosts],
            watch_stdin=not daemon,
            buffer_bytes=self.port_buffer_bytes,
            control_path=str(self.control_path),
        )
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        log = open(STATE_DIR / f"{self.tag}.log", "wb")  # noqa: SIM115 - handed to the child
        self.forwarder = subprocess.Popen(
            [sys.executable, "-m", "thinwire.cluster.forwarder", config.to_json()],
            stdin=subprocess.DEVNULL if daemon else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=daemon,
        )
        log.close()
        self.forwarder_pid = self.forwarder.pid
        assert self.forwarder.stdout is not None
        ready = select.select([self.forwarder.stdout], [], [], 30)[0]
        line = self.forwarder.stdout.readline().decode().strip() if ready else ""
        self.forwarder.stdout.close()
        if line != "ready":
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.forwarder.wait(timeout=10)
            errors = (STATE_DIR / f"{self.tag}.log").read_text(errors="replace")[-2000:]
            raise ClusterError(f"the cluster's forwarder did not start:\n{errors}")

    @property
    def control_path(self) -> Path:
        """The forwarder's socket for faults (:mod:`thinwire.cluster.faults`)."""
        return STATE_DIR / f"{self.tag}.faults"

    def fault(
        self,
        host: int,
        down: str | float | None = None,
        loss: float | None = None,
        rate: str | float | None = None,
        clear: bool = False,
    ) -> None:
        """Break host ``host``'s link while the cluster runs: ``down`` for a duration,
        ``loss`` (a share of packets), another downlink ``rate``; ``clear`` undoes all."""
        order = fault_order(host, len(self.hosts), down, loss, rate, clear)
        send_fault(self.control_path, order)

    def _device(self, host: Host) -> str:
        return f"tw{self.tag}h{host.rank}"

    def _configure(self, host: Host) -> None:
        ns, dev = host.namespace, self._device(host)
        _ip("link", "set", dev, "netns", ns)
        _ip("-n", ns, "link", "set", dev, "name", host.interface)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{host.address}/24", "dev", host.interface)
        _ip("-n", ns, "link", "set", host.interface, "mtu", str(self.mtu), "up")
        _run(["ip", "netns", "exec", ns, "sysctl", "-q", *(f"{k}={v}" for k, v in TCP_TUNING)])
        if self.rate_bps is not None:
            tbf = tbf_arguments(self.rate_bps, self.mtu, self.uplink_queue)
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", host.interface,
                  "root", *tbf])  # fmt: skip

    def down(self) -> None:
        """Stop the forwarder (it deletes the namespaces) and make sure they are gone."""
        self._stop_forwarder()
        for host in self.hosts:
            if os.path.exists(os.path.join(NETNS_DIR, host.namespace)):
                _ip("netns", "delete", host.namespace, check=False)
        (STATE_DIR / f"{self.tag}.json").unlink(missing_ok=True)
        (STATE_DIR / f"{self.tag}.log").unlink(missing_ok=True)

    def _stop_forwarder(self) -> None:
        """Stop this cluster's forwarder: our child, or (attached) the process whose command
        line names this cluster's devices, never a stranger that reused the pid."""
        pid = self.forwarder_pid
        if self.forwarder is not None:
            with contextlib.suppress(ProcessLookupError):
                self.forwarder.terminate()
            try:
                self.forwarder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.forwarder.kill()
                self.forwarder.wait()
        elif pid is not None and _is_forwarder(pid, self.tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            _wait_gone(pid, 10)
        self.forwarder = None
        self.forwarder_pid = None

    def forwarder_alive(self) -> bool:
        """Whether the switch still runs (a dead one means every link is down)."""
        if self.forwarder is not None:
            return self.forwarder.poll() is None
        return self.forwarder_pid is not None and _is_forwarder(self.forwarder_pid, self.tag)

    def __enter__(self) -> EmulatedCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- running commands on the hosts ----------------------------------------------------

    def host_env(
        self, host: Host, port: int, base: Mapping[str, str] | None = None, local_rank: int = 0
    ) -> dict[str, str]:
        """The environment ``torchrun`` would give local rank ``local_rank`` of ``host``."""
        return rank_env(self, host, local_rank, port, base)

    def run(
        self,
        command: Sequence[str],
        port: int = 29500,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> list[int]:
        """Run ``command`` as every rank (``ranks_per_host`` per host); the exit codes."""
        return run_ranks(self, command, port, timeout, env)

    # -- state for the command line -------------------------------------------------------

    def _write_state(self) -> None:
        state = {
            "tag": self.tag,
            "hosts": len(self.hosts),
            "ranks_per_host": self.ranks_per_host,
            "bandwidth": self.bandwidth,
            "latency": self.latency,
            "uplink_queue": self.uplink_queue,
            "forwarder_pid": self.forwarder_pid,
        }
        (STATE_DIR / f"{self.tag}.json").write_text(json.dumps(state))

    @classmethod
    def attach(cls, tag: str | None = None) -> EmulatedCluster:
        """The running cluster ``tag`` (or the only one) started by ``thinwire cluster up``."""
        states = {}
        for path in STATE_DIR.glob("*.json") if STATE_DIR.exists() else []:
            with contextlib.suppress(OSError, ValueError):
                states[path.stem] = json.loads(path.read_text())
        alive = {
            t: s
            for t, s in states.items()
            if isinstance(s, dict) and _is_forwarder(int(s.get("forwarder_pid") or -1), t)
        }
        if tag is None:
            if len(alive) != 1:
                raise ClusterError(
                    "no emulated cluster is up (start one: thinwire cluster up --hosts 4)"
                    if not alive
                    else f"several clusters are up ({', '.join(sorted(alive))}); pick one: --tag"
                )
            tag = next(iter(alive))
        if tag not in alive:
            raise ClusterError(f"no emulated cluster {tag!r} is up; running: {sorted(alive)}")
        state = alive[tag]
        cluster = cls(
            state["hosts"], state["bandwidth"], state["latency"], tag=tag,
            ranks_per_host=state.get("ranks_per_host", 1),
            uplink_queue=state.get("uplink_queue"),
        )  # fmt: skip
        cluster.forwarder_pid = state["forwarder_pid"]
        return cluster

    def describe(self) -> dict[str, Any]:
        """Hosts, addresses and link settings, for results files and ``status``."""
        return {
            "tag": self.tag,
            "hosts": len(self.hosts),
            "ranks_per_host": self.ranks_per_host,
            "bandwidth_bps": self.rate_bps,
            "latency_s": self.latency_s,
            "mtu": self.mtu,
            "uplink_queue_packets": self.uplink_queue,
            "addresses": [h.address for h in self.hosts],
        }


def list_namespaces() -> list[str]:
    """Names of the network namespaces that thinwire clusters created."""
    if not os.path.isdir(NETNS_DIR):
        return []
    return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(PREFIX))


def remove_leftovers() -> list[str]:
    """Delete namespaces of clusters whose forwarder is gone (a killed run); return them."""
    live_tags = set()
    if STATE_DIR.exists():
        for path in STATE_DIR.glob("*.json"):
            try:
                pid = json.loads(path.read_text())["forwarder_pid"]
            except (ValueError, KeyError):
                pid = None
            if pid is not None and _is_forwarder(pid, path.stem):
                live_tags.add(path.stem)
            else:
                path.unlink(missing_ok=True)
                (STATE_DIR / f"{path.stem}.log").unlink(missing_ok=True)
    removed = []
    for namespace in list_namespaces():
        tag = namespace[len(PREFIX) :].split("-")[0]
        if tag not in live_tags and not _forwarder_running(tag):
            _ip("netns", "delete", namespace, check=False)
            removed.append(namespace)
    return removed


def _forwarder_running(tag: str) -> bool:
    """Whether a forwarder for ``tag`` runs (a cluster being built has no state file yet)."""
    return any(_is_forwarder(int(pid), tag) for pid in filter(str.isdigit, os.listdir("/proc")))


def _is_forwarder(pid: int, tag: str) -> bool:
    """Whether process ``pid`` is the forwarder of cluster ``tag`` (not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return (
        b"thinwire.cluster.forwarder" in cmdline
        and f'"tw{tag}h0"'.encode() in cmdline
        and process_alive(pid)
    )


@contextlib.contextmanager
def _cluster_lock() -> Iterator[None]:
    """An exclusive lock across processes for building clusters and removing leftovers."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (one not yet reaped is gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if process_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _ip(*args: str, check: bool = True) -> None:
    _run(["ip", *args], check=check)


def _run(argv: list[str], check: bool = True) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
