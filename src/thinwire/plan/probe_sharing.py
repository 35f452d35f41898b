"""How messages crossing one link together share it: in turn, or side by side.

Part of ``thinwire probe``. Every pair of ranks between host 0 and host 1 sends one
message of the same size at the same moment, and each receiver times its message from
the barrier to its arrival. Where each message leaves as one burst (the sender's socket
buffer takes it whole) the link's queue serves the bursts one after another: with ``k``
pairs the first arrives after ``1 / k`` of the time the last takes. Where a message is
larger than the sender's buffer it leaves as acknowledgements come back, the flows
interleave, and all arrive together (that is the mechanism expected; what the probe
reports is only what it measured). The share measured per size,

    in_turn = (last - first) / (last * (1 - 1 / k)),

is 1 for the first (the pipelines crossing the link drift apart: the planner simulates
the link first in first out) and 0 for the second (they keep step, each at its share:
a fluid link); :mod:`thinwire.plan.shared_links` weighs the two by it.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence


def in_turn_share(arrivals_s: Sequence[float]) -> float:
    """The share of a link served in turn, from the arrival times (from a common start) of
    messages of one size sent on it together: 1 in turn, 0 side by side, clamped."""
    if len(arrivals_s) < 2:
        raise ValueError("the share served in turn needs two messages or more")
    first, last, k = min(arrivals_s), max(arrivals_s), len(arrivals_s)
    if not (first >= 0 and last > 0):
        raise ValueError(f"arrival times must be >= 0 and not all 0, got {list(arrivals_s)}")
    return min(1.0, max(0.0, (last - first) / (last * (1 - 1 / k))))


def share_at(shares: Sequence[tuple[float, float]], nbytes: float) -> float | None:
    """A share (served in turn; of latency hidden) at ``nbytes`` from (bytes, share)
    measured at some sizes: between two sizes linear in the logarithm, the nearest one's
    outside them; ``None`` where nothing was measured (a probe from before thinwire
    measured it)."""
    if not shares:
        return None
    points = sorted(shares)
    if nbytes <= points[0][0]:
        return points[0][1]
    for (low, low_share), (high, high_share) in itertools.pairwise(points):
        if nbytes <= high:
            along = math.log(nbytes / low) / math.log(high / low)
            return low_share + along * (high_share - low_share)
    return points[-1][1]


def probe_sharing(
    rank: int, ranks_per_host: int, pairs: int, sizes: Sequence[float], repeats: int
) -> tuple[tuple[float, float], ...]:
    """(bytes, share served in turn) at each of ``sizes``, ``pairs`` ranks of host 0 each
    sending to its counterpart on host 1 at once; every rank calls this and gets the same
    answer (the median over ``repeats``)."""
    import time

    import torch
    import torch.distributed as dist

    local = rank % ranks_per_host
    sender = rank < ranks_per_host and local < pairs
    receiver = ranks_per_host <= rank < 2 * ranks_per_host and local < pairs
    world = dist.get_world_size()
    measured = []
    for nbytes in sizes:
        data = torch.zeros(int(nbytes) // 4)
        shares = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            if sender:
                dist.send(data, rank + ranks_per_host)
            elif receiver:
                dist.recv(data, rank - ranks_per_host)
            took = time.perf_counter() - start if receiver else -1.0
            every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, torch.tensor([took], dtype=torch.float64))
            arrivals = [float(t.item()) for t in every if t.item() >= 0]
            shares.append(in_turn_share(arrivals))
        measured.append((float(nbytes), statistics.median(shares)))
    return tuple(measured)
