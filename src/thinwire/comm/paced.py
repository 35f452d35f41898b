"""An uneven all-to-all that limits how many bytes head for one rank at once.

Every rank sending to every other at the same moment (``all_to_all_single``) makes each
rank's downlink the meeting point of N - 1 bursts. A cheap switch holds a few hundred
kilobytes per port; past that it drops packets, and the senders' TCP retransmits or waits
out a timeout: *incast*. So a rank keeps at most :data:`PACE_BYTES` (128 KiB by default)
in flight towards its partners. On 16 emulated hosts with a core each (100 Mbit/s, a
256 KB buffer a switch port) it halved the partitioned sparse exchange's step with
``keep=4`` (0.81 s to 0.41; TCP resent 9,092 segments and timed out 19 times unpaced, 59
and none paced) and left ``keep=1``'s as it was (0.296 s, 0.294); on 8 hosts sharing two
cores it made ``keep=1`` 3-9 % slower (docs/sparse.md, "Pacing the all-to-all").
``THINWIRE_PACE_BYTES`` sets the budget; 0 turns pacing off.

Paced, the messages travel in windows of partners: at offset ``i`` rank ``r`` sends to
``r + i`` and receives from ``r - i`` (mod N), each offset a permutation of the ranks, so
that every rank receives from as many senders as it sends to. A window holds as many
offsets as keep this rank's messages in flight within :data:`PACE_BYTES` (at least one,
all N - 1 where the messages are small: then it is the plain all-to-all). Ranks may
choose different windows: each posts its sends and receives in offset order and waits
for a window before the next, and the ranks' first windows all hold offset 1, so by
induction over the offsets every send meets its receive (no deadlock).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor

#: the budget where ``THINWIRE_PACE_BYTES`` is unset: half the 256 KB a port of the
#: emulated switch holds, as measured
DEFAULT_PACE_BYTES = 128 * 1024


def _budget_from_environment() -> int:
    """``THINWIRE_PACE_BYTES``, checked (unset: :data:`DEFAULT_PACE_BYTES`)."""
    text = os.environ.get("THINWIRE_PACE_BYTES", "").strip() or str(DEFAULT_PACE_BYTES)
    if not text.isdigit():
        raise ValueError(
            f"THINWIRE_PACE_BYTES must be a whole number of bytes >= 0 (0: no pacing), got "
            f"{text!r}; unset it or set it to, say, 131072"
        )
    return int(text)


#: bytes a rank keeps in flight towards its partners at once (0: no pacing, every message
#: at once). The environment variable ``THINWIRE_PACE_BYTES`` sets it at import; unset,
#: :data:`DEFAULT_PACE_BYTES`.
PACE_BYTES = _budget_from_environment()
#: the tag of the paced exchange's point-to-point messages (apart from other traffic)
PACE_TAG = 0x7477


def window_of(split_sizes: Sequence[int], rank: int, budget: int | None = None) -> int:
    """How many partner offsets this rank sends to at once: as many of its largest
    message to others (``split_sizes``: bytes to each rank) as fit ``budget`` (default
    :data:`PACE_BYTES`; at least 1, at most N - 1; all N - 1 where ``budget`` is 0)."""
    budget = PACE_BYTES if budget is None else budget
    world = len(split_sizes)
    largest = max((n for j, n in enumerate(split_sizes) if j != rank), default=0)
    if budget <= 0 or largest == 0:  # pacing off, or nothing to send
        return max(1, world - 1)
    return max(1, min(world - 1, budget // largest))


def paced_all_to_all(
    output: Tensor,
    input: Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    every_split_sizes: Sequence[Sequence[int]],
    group: dist.ProcessGroup | None = None,
    budgets: Sequence[int] | None = None,
) -> None:
    """``torch.distributed.all_to_all_single(output, input, output_split_sizes,
    input_split_sizes)`` (1-D tensors), its messages in windows of partners (see the
    module docstring). ``every_split_sizes`` and ``budgets``: every rank's
    ``input_split_sizes`` and pacing budget (default: this rank's :data:`PACE_BYTES` for
    all), so that all ranks agree whether anyone paces, even where their budgets differ:
    where no rank needs to, it is the plain all-to-all."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    unit = input.element_size()
    budgets = [PACE_BYTES] * world if budgets is None else list(budgets)
    windows = [
        window_of([n * unit for n in sizes], source, budgets[source])
        for source, sizes in enumerate(every_split_sizes)
    ]
    if min(windows) >= world - 1:
        dist.all_to_all_single(
            output,
            input,
            output_split_sizes=list(output_split_sizes),
            input_split_sizes=list(input_split_sizes),
            group=group,
        )
        return
    window = windows[rank]
    received = output.split(list(output_split_sizes))
    sending = input.split(list(input_split_sizes))
    received[rank].copy_(sending[rank])
    for first in range(1, world, window):
        ops = []
        for offset in range(first, min(first + window, world)):
            to, source = (rank + offset) % world, (rank - offset) % world
            ops.append(dist.P2POp(dist.isend, sending[to], _peer(group, to), group, PACE_TAG))
            ops.append(
                dist.P2POp(dist.irecv, received[source], _peer(group, source), group, PACE_TAG)
            )
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _peer(group: dist.ProcessGroup | None, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (what point-to-point calls take)."""
    return rank if group is None else dist.get_global_rank(group, rank)
