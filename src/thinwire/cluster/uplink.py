"""A host's uplink in the emulated cluster: the ``tbf`` qdisc that limits what it sends.

The queue holds, by default, 10 ms of bytes at the link rate (at least
:data:`MIN_UPLINK_QUEUE_PACKETS` packets). Short, so that a ring's bulk data does not
delay a host's other packets (a pipeline's activations) for long: with 256 packets the
1F1B pipelines of a 27 M GPT on 2 x 4 hosts at 100 Mbit/s stepped 1 s slower (4.07 and
4.18 s against 3.19 and 3.27). But an all-to-all among many hosts puts a burst from every
connection in it at once, and there the short queue drops packets: 16 hosts' all-to-alls
at 10 Mbit/s lost a tenth of theirs and stalled on TCP timeouts; 256 packets lost none
(docs/sparse.md, "With the cut, and the bed's uplink queue"). A Linux host's fq_codel does
neither, and this kernel has no fair-queueing qdisc, so the queue is a choice
(``EmulatedCluster(uplink_queue=...)``, ``thinwire bench --uplink-queue``).
"""

from __future__ import annotations

#: the default queue's least number of packets (it holds 10 ms of the link otherwise)
MIN_UPLINK_QUEUE_PACKETS = 4


def check_uplink_queue(packets: int | None) -> int | None:
    """``packets`` if it is a valid uplink queue (None: the default, 10 ms of bytes),
    else a ``ValueError`` saying what to pass."""
    if packets is None:
        return None
    if isinstance(packets, bool) or not isinstance(packets, int) or not 2 <= packets <= 10_000:
        raise ValueError(
            f"the uplink queue is a number of packets from 2 to 10000 (leave it out for 10 "
            f"ms of the link), got {packets!r}"
        )
    return packets


def tbf_arguments(rate_bps: float, mtu: int, queue_packets: int | None) -> list[str]:
    """``tc qdisc add`` arguments of a ``tbf`` limiting an uplink to ``rate_bps`` with a
    burst of 2 ms (at least two packets) and a queue of ``queue_packets`` packets of
    ``mtu`` bytes (None: the default)."""
    bytes_per_ms = rate_bps / 8e3
    burst = int(max(2 * mtu, 2 * bytes_per_ms))
    limit = int(max(MIN_UPLINK_QUEUE_PACKETS * mtu, 10 * bytes_per_ms))
    if queue_packets is not None:
        limit = queue_packets * mtu
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]
