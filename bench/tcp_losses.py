"""What the emulated cluster's TCP lost while a benchmark ran: retransmissions and timeouts.

    thinwire bench --network emulated ... & python bench/tcp_losses.py $! [--out FILE]

Samples every thinwire namespace's TCP counters (``nstat``: retransmitted segments,
retransmission timeouts) and its uplink qdisc's drops (``tc -s qdisc``) once a second while
process PID runs, keeps each namespace's last reading (the counters start at zero with the
namespace and vanish with it), and prints their sums when PID is gone. Everything the run
did is counted: its probe and every method, so compare runs of one method each. Needs root,
``ip``, ``nstat`` and ``tc`` (iproute2).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from pathlib import Path

from thinwire.cluster.emulated import list_namespaces, process_alive

COUNTERS = ("TcpRetransSegs", "TcpExtTCPTimeouts")


def _in_namespace(namespace: str, *command: str) -> str:
    done = subprocess.run(
        ["ip", "netns", "exec", namespace, *command], capture_output=True, text=True, timeout=5
    )
    return done.stdout


def reading(namespace: str) -> dict[str, int] | None:
    """``namespace``'s counters now (``None`` if it is gone or unreadable)."""
    try:
        counters = _in_namespace(namespace, "nstat", "-az", *COUNTERS)
        qdisc = _in_namespace(namespace, "tc", "-s", "qdisc", "show", "dev", "tw0")
    except (OSError, subprocess.SubprocessError):
        return None
    values = {name: int(value) for name, value in re.findall(r"^(\S+)\s+(\d+)", counters, re.M)}
    if not values:
        return None
    found = {name: values.get(name, 0) for name in COUNTERS}
    found["uplink_drops"] = sum(int(n) for n in re.findall(r"dropped (\d+)", qdisc))
    return found


def watch(pid: int, every_s: float = 1.0) -> dict[str, int]:
    """Sample until ``pid`` exits; the sums of the namespaces' last readings."""
    last: dict[str, dict[str, int]] = {}
    while process_alive(pid):
        for namespace in list_namespaces():
            found = reading(namespace)
            if found is not None:
                last[namespace] = found
        time.sleep(every_s)
    keys = (*COUNTERS, "uplink_drops")
    totals = {key: sum(found[key] for found in last.values()) for key in keys}
    return {"namespaces": len(last), **totals}


def main() -> None:
    """Watch the process named on the command line; print (and write) the totals."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pid", type=int, help="the benchmark's process id")
    parser.add_argument("--out", type=Path, help="write the totals here as JSON")
    args = parser.parse_args()
    totals = watch(args.pid)
    print(
        f"{totals['namespaces']} namespaces: {totals['TcpRetransSegs']} TCP segments "
        f"retransmitted, {totals['TcpExtTCPTimeouts']} retransmission timeouts, "
        f"{totals['uplink_drops']} packets dropped by the uplinks' qdiscs"
    )
    if args.out:
        args.out.write_text(json.dumps(totals) + "\n")


if __name__ == "__main__":
    main()
