"""The kernel's TCP counters in every emulated host's namespace, read every few seconds.

    python bench/tcp_counters.py --every 20 > tcp-counters.jsonl      (Ctrl-C to stop)

Runs beside ``thinwire bench`` or ``thinwire cluster`` (as root, which they need too): each
line is one reading, ``{"t": "HH:MM:SS", "ns": {namespace: {counter: value}}}`` for every
``thinwire-*`` network namespace alive then, with the counters that say whether a link
loses packets: retransmitted and sent segments, TCP timeouts, loss probes, retransmissions
the host's own qdisc refused (``TCPRetransFail``). The counters grow from the namespace's
creation; differences between readings give a plan's share (docs/planner-measurements.md,
"The dense plans at 10 Mbit/s, and the bed's uplink queue").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

from thinwire.cluster import list_namespaces

#: the counters read, by the line of /proc/net/netstat or /proc/net/snmp they are on
COUNTERS = {
    "TcpExt": ["TCPTimeouts", "TCPLossProbes", "TCPLostRetransmit", "TCPSpuriousRTOs",
               "TCPRetransFail"],
    "Tcp": ["RetransSegs", "OutSegs", "InSegs"],
}  # fmt: skip


def parse(text: str) -> dict[str, int]:
    """The :data:`COUNTERS` in the text of ``/proc/net/netstat`` or ``/proc/net/snmp``
    (pairs of lines: names, then values, each led by the same ``Prefix:``)."""
    lines = text.splitlines()
    found: dict[str, int] = {}
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        keys, numbers = names.split(), values.split()
        wanted = COUNTERS.get(keys[0].rstrip(":"), []) if keys else []
        for key, number in zip(keys[1:], numbers[1:], strict=False):
            if key in wanted:
                found[key] = int(number)
    return found


def read(namespace: str) -> dict[str, int]:
    """The counters of ``namespace`` now."""
    counters: dict[str, int] = {}
    for path in ("/proc/net/netstat", "/proc/net/snmp"):
        done = subprocess.run(
            ["ip", "netns", "exec", namespace, "cat", path], capture_output=True, text=True
        )
        counters.update(parse(done.stdout))
    return counters


def main(argv: list[str] | None = None) -> None:
    """Print a reading every ``--every`` seconds until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=20.0, help="seconds between readings")
    args = parser.parse_args(argv)
    if args.every <= 0:
        raise SystemExit(f"--every must be > 0 seconds, got {args.every}")
    try:
        while True:
            hosts = {n: read(n) for n in list_namespaces()}
            reading = {"t": time.strftime("%H:%M:%S"), "ns": hosts}
            print(json.dumps(reading), flush=True)
            time.sleep(args.every)
    except KeyboardInterrupt:
        return


if __name__ == "__main__":
    main()
