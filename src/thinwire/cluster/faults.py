"""Faults on the emulated cluster's links, ordered while it runs.

    cluster.fault(1, down="5s")        # host 1's link drops every packet for 5 s
    cluster.fault(2, loss=0.01)        # 1 % of host 2's packets are lost, from now on
    cluster.fault(3, rate="10mbit")    # host 3's downlink slows to 10 Mbit/s
    cluster.fault(2, clear=True)       # host 2's link as the cluster was built

or from a shell: ``thinwire cluster fault --host 1 --down 5s``. The order travels as a JSON
datagram to the cluster's forwarder (:mod:`thinwire.cluster.forwarder`), which answers
``ok`` once the fault applies or says why it refused it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any

from thinwire.cluster.units import parse_duration, parse_rate


class FaultError(RuntimeError):
    """A fault could not be ordered: bad values, or no forwarder answered."""


def fault_order(
    host: int,
    hosts: int,
    down: str | float | None = None,
    loss: float | None = None,
    rate: str | float | None = None,
    clear: bool = False,
) -> dict[str, Any]:
    """The checked order for ``host`` of a cluster of ``hosts`` (see the module's text)."""
    if isinstance(host, bool) or not isinstance(host, int) or not 0 <= host < hosts:
        raise FaultError(f"host must be an integer from 0 to {hosts - 1}, got {host!r}")
    if clear:
        if (down, loss, rate) != (None, None, None):
            raise FaultError("clear=True takes no other fault: clear first, then order anew")
        return {"host": host, "clear": True}
    order: dict[str, Any] = {"host": host}
    if down is not None:
        order["down_s"] = parse_duration(down, "down", most_s=86_400.0)
    if loss is not None:
        if isinstance(loss, bool) or not isinstance(loss, int | float) or not 0 <= loss <= 1:
            raise FaultError(f"loss must be a share of packets from 0 to 1, got {loss!r}")
        order["loss"] = float(loss)
    if rate is not None:
        rate_bps = parse_rate(rate)
        if rate_bps is None:
            raise FaultError("rate must be a rate such as '10mbit' (clear=True restores it)")
        order["rate_bps"] = rate_bps
    if len(order) == 1:
        raise FaultError("order a fault: down='5s', loss=0.01, rate='10mbit' or clear=True")
    return order


def send_fault(control_path: Path, order: dict[str, Any], timeout_s: float = 5.0) -> None:
    """Hand ``order`` to the forwarder listening on ``control_path``; raise
    :class:`FaultError` unless it answers ``ok`` within ``timeout_s``."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    client.bind(f"\0thinwire-fault-{os.getpid()}-{id(client)}")  # abstract: nothing to delete
    client.settimeout(timeout_s)
    try:
        client.sendto(json.dumps(order).encode(), str(control_path))
        answer = client.recv(4096).decode()
    except (FileNotFoundError, ConnectionRefusedError) as error:
        raise FaultError(
            f"no forwarder listens on {control_path}: is the cluster up? ({error})"
        ) from error
    except TimeoutError as error:
        raise FaultError(f"the forwarder did not answer within {timeout_s} s") from error
    finally:
        with contextlib.suppress(OSError):
            client.close()
    if answer != "ok":
        raise FaultError(f"the forwarder refused the fault {order}: {answer}")
