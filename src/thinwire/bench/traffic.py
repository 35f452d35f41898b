"""Bytes this process sent over TCP, within its host and to other hosts, from the kernel's
own per-socket counters (``ss -ti``: ``bytes_acked``, payload only, no headers).

A peer at the socket's own address is on the same host (the ranks of an emulated host share
its namespace and its address, and talk over its loopback); any other address is another
host. Everything counts: gloo's pairs (tensor-parallel, pipeline and data-parallel
traffic), the rendezvous store. Sockets closed between two readings are lost, which
gloo's long-lived pairs never are.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

_ACKED = re.compile(r"bytes_acked:(\d+)")


@dataclass(frozen=True)
class Traffic:
    """Payload bytes sent within the host and to other hosts."""

    within_host: int = 0
    between_hosts: int = 0

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.within_host - other.within_host, self.between_hosts - other.between_hosts
        )


def _address(endpoint: str) -> str:
    host, _, _ = endpoint.rpartition(":")
    return host.strip("[]").removeprefix("::ffff:")


def parse_ss(text: str, pid: int) -> Traffic:
    """The bytes ``pid``'s sockets sent, from ``ss -tinpH`` output (a socket's line, then
    its indented details)."""
    within = between = 0
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line or line[0].isspace() or f"pid={pid}," not in line:
            continue
        fields = line.split()
        users = next(k for k, field in enumerate(fields) if field.startswith("users:"))
        local, peer = _address(fields[users - 2]), _address(fields[users - 1])
        details = lines[i + 1] if i + 1 < len(lines) and lines[i + 1][:1].isspace() else ""
        match = _ACKED.search(details)
        if match is None:
            continue
        sent = max(0, int(match.group(1)) - 1)  # the SYN counts as one acked byte
        if local == peer:
            within += sent
        else:
            between += sent
    return Traffic(within, between)


def sent_now() -> Traffic:
    """What this process's open TCP sockets have sent so far."""
    if shutil.which("ss") is None:
        raise RuntimeError(
            "counting bytes per link needs `ss` (Debian package iproute2): apt-get install iproute2"
        )
    text = subprocess.run(
        ["ss", "-tinpH", "state", "established"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return parse_ss(text, os.getpid())
