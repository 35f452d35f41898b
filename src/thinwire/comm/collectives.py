"""Communicators: the only code in thinwire that calls ``torch.distributed``.

A communicator executes one *round* of requests from many exchange protocols at once
(every tensor of a bucket, in lock-step), fusing them: all ``Sum`` requests of one dtype
become one flat buffer and one all-reduce, all ``Gather`` requests become one byte buffer
and one all-gather. It counts the bytes this rank contributes and, under the ring
algorithm, puts on the wire.

Three communicators:

- :class:`AllReduceCommunicator` (decentralised ring all-reduce) executes ``Sum`` and
  ``Max``; it refuses compressors whose payloads must be gathered, naming both.
- :class:`AllGatherCommunicator` executes every request with all-gather; sums and maxima
  are reduced locally in rank order, so every rank computes the same bits.
- :class:`DirectCommunicator` gathers as the all-gather one does, but in one step: every
  rank sends its payload to every other at once (an all-to-all), so a round waits for one
  network delay instead of the ring's N - 1 (all-gather) or 2 (N - 1) (all-reduce), for
  the same bytes as the all-gather. For small payloads over long round trips.

Non-finite gradients are caught without a hang: a rank whose input is not finite *poisons*
its first round (NaN in sums, +inf in maxima, a status byte in gathers), every rank sees
the poison in the answer after the same collective, and every rank raises. A *lazy* round
(``execute(..., lazy=True)``, what the engine asks for on a GPU) takes the poison as a
device flag and answers with one, so that nothing is read back on the host: the engine
reads the step's flags once.
"""

from __future__ import annotations

import contextlib
import datetime
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from thinwire.comm.framing import frame, split_bytes
from thinwire.comm.scatter import merge_flags, scatter_payload_bytes, scatter_round
from thinwire.compress.base import (
    Aggregation,
    Compressor,
    Op,
    Request,
)
from thinwire.compress.finite import all_finite, not_finite_flag
from thinwire.errors import CommunicationError, IncompatibleCompressorError

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Traffic:
    """Bytes one rank moved. ``payload``: what it contributed to collectives; ``sent`` and
    ``received``: what the ring algorithm makes it send and receive; ``collectives``: how
    many collectives it issued."""

    payload: int = 0
    sent: int = 0
    received: int = 0
    collectives: int = 0

    def add(self, other: Traffic) -> None:
        """Accumulate ``other`` into this record."""
        self.payload += other.payload
        self.sent += other.sent
        self.received += other.received
        self.collectives += other.collectives


@dataclass
class RoundResult:
    """The answers to one round of requests (in request order) and whether any rank's
    input was poisoned (non-finite)."""

    answers: list[Any]
    #: a device bool tensor after a lazy round (see :meth:`Communicator.execute`)
    poisoned: bool | Tensor
    traffic: Traffic = field(default_factory=Traffic)


class Communicator(ABC):
    """Executes rounds of exchange requests over a process group.

    Args:
        group: the process group (``None``: the default group).
        world_size: for a communicator without a process group (the parameter server's
            links, the planner's single process): the number of ranks its compressor
            averages over; ``rank``: this participant's index.
    """

    name: str = "communicator"
    #: whether the engine checks, at its first exchange, that every rank of ``group``
    #: starts at the same step from the same checkpoint (communicators without a group of
    #: peers, such as the parameter server's links, have their own resume protocol)
    checks_start: bool = True
    #: whether every round's answer is checked for NaN and infinity (not only the
    #: ranks' poison): a non-finite value summed by a transparent compressor
    #: (:attr:`~thinwire.compress.base.Compressor.transparent`) is then caught without
    #: poisoning
    checks_sums: bool = False

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        world_size: int | None = None,
        rank: int | None = None,
    ) -> None:
        if world_size is not None:  # no process group: messages go another way
            self.group, self.world_size, self.rank, self.timeout = None, world_size, rank or 0, None
            return
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call "
                "torch.distributed.init_process_group(...) first (or launch with torchrun)"
            )
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout = group_timeout(group)

    def supports(self, op: Op) -> bool:
        """Whether this communicator can execute requests of kind ``op``."""
        return True

    def check(self, compressor: Compressor) -> None:
        """Refuse a compressor whose payloads this communicator cannot aggregate."""
        if compressor.aggregation is Aggregation.GATHER and not self.supports(Op.GATHER):
            raise IncompatibleCompressorError(
                f"compressor {compressor.name!r} sends payloads that must be gathered "
                f"(they cannot be summed), but communicator {self.name!r} only sums; "
                "use communicator='allgather' (or 'auto')"
            )
        if compressor.scatters and not self.supports(Op.SCATTER):
            raise IncompatibleCompressorError(
                f"compressor {compressor.name!r} with partitioned=True sends each rank its "
                f"own part of the index space (an all-to-all), which communicator "
                f"{self.name!r} cannot carry (the 'allgather' and 'direct' communicators of "
                "data parallelism can; the parameter server cannot yet): use "
                "partitioned=False here"
            )

    def execute(
        self, requests: Sequence[Request], poison: bool | Tensor = False, lazy: bool = False
    ) -> RoundResult:
        """Run one round: fuse ``requests`` into as few collectives as possible, wait.

        ``poison``: this rank's input was not finite (a bool, or a device bool tensor).
        ``lazy``: answer whether any rank was poisoned as a bool tensor on the payloads'
        device, rather than reading it back (a communicator that cannot answer so
        answers with a bool)."""
        for request in requests:
            if not self.supports(request.op):
                raise IncompatibleCompressorError(
                    f"communicator {self.name!r} cannot execute a {request.op.value!r} request"
                )
        return self._execute(requests, poison, lazy)

    def _collective(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Call one ``torch.distributed`` collective; turn its failure into a clear error."""
        run_collective(f"a {self.name} collective", fn, *args, group=self.group, **kwargs)

    @abstractmethod
    def _execute(
        self, requests: Sequence[Request], poison: bool | Tensor, lazy: bool
    ) -> RoundResult: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size})"


class AllReduceCommunicator(Communicator):
    """Ring all-reduce: one fused all-reduce per (op, dtype) in a round."""

    name = "allreduce"
    checks_sums = True

    def supports(self, op: Op) -> bool:
        """Sums and maxima only."""
        return op in (Op.SUM, Op.MAX)

    def _execute(
        self, requests: Sequence[Request], poison: bool | Tensor, lazy: bool
    ) -> RoundResult:
        traffic = Traffic()
        answers: list[Any] = [None] * len(requests)
        poisoned: bool | Tensor = False
        for (op, dtype), members in group_by_op_and_dtype(requests).items():
            tensors = [t for i in members for t in requests[i].tensors]
            scratch = len(members) == 1 and requests[members[0]].scratch
            flat = _flatten(tensors, dtype, in_place=scratch)
            fill = math.inf if op is Op.MAX else math.nan
            if isinstance(poison, Tensor):  # one value is enough to poison every rank's sum
                if flat.numel():
                    flat[:1] = torch.where(poison, fill, flat[:1])
            elif poison:
                flat.fill_(fill)
            reduce_op = dist.ReduceOp.SUM if op is Op.SUM else dist.ReduceOp.MAX
            self._collective(dist.all_reduce, flat, op=reduce_op)
            traffic.add(
                _ring_allreduce_traffic(flat.numel() * flat.element_size(), self.world_size)
            )
            if lazy and flat.numel():
                flag = not_finite_flag([flat])
                poisoned = flag if poisoned is False else poisoned | flag
            else:
                poisoned |= not all_finite(flat)
            pieces = iter(_split(flat, tensors))
            for i in members:
                answers[i] = [next(pieces) for _ in requests[i].tensors]
        return RoundResult(answers, poisoned, traffic)


class AllGatherCommunicator(Communicator):
    """All-gather everything in one fused byte buffer per round; reduce sums locally.

    Two kinds of request go another way, since gathering them would make every rank
    receive every rank's payload: scatters (an uneven all-to-all, :mod:`thinwire.comm.scatter`)
    and sums of integers (one all-reduce: integer addition is exact in any order, so every
    rank still gets the same bits)."""

    name = "allgather"

    def _execute(
        self, requests: Sequence[Request], poison: bool | Tensor, lazy: bool
    ) -> RoundResult:
        kinds = gathering_routes(requests)
        if not kinds["scatter"] and not kinds["count"]:
            return self._gather_round(requests, poison, lazy)
        answers: list[Any] = [None] * len(requests)
        poisoned: bool | Tensor = False
        traffic = Traffic()
        if kinds["gather"]:
            done = self._gather_round([requests[i] for i in kinds["gather"]], poison, lazy)
            for i, answer in zip(kinds["gather"], done.answers, strict=True):
                answers[i] = answer
            poisoned, traffic = done.poisoned, done.traffic
        if kinds["scatter"]:
            scattered = [requests[i] for i in kinds["scatter"]]
            found, flag, sent, received = scatter_round(
                scattered, poison, self.world_size, self.rank, self._collective
            )
            for i, answer in zip(kinds["scatter"], found, strict=True):
                answers[i] = answer
            poisoned = merge_flags(poisoned, flag)
            payload = scatter_payload_bytes(scattered)
            traffic.add(Traffic(payload=payload, sent=sent, received=received, collectives=2))
        if kinds["count"]:
            flag = self._sum_counts([requests[i] for i in kinds["count"]], kinds["count"],
                                    answers, poison, traffic)  # fmt: skip
            poisoned = merge_flags(poisoned, flag)
        if not lazy and isinstance(poisoned, Tensor):
            poisoned = bool(poisoned)
        return RoundResult(answers, poisoned, traffic)

    def _sum_counts(
        self,
        requests: Sequence[Request],
        places: Sequence[int],
        answers: list[Any],
        poison: bool | Tensor,
        traffic: Traffic,
    ) -> bool | Tensor:
        """All-reduce integer sums (one per dtype) with a poison count at the end; put the
        answers at ``places``; return whether any rank was poisoned."""
        poisoned: bool | Tensor = False
        for (_, dtype), members in group_by_op_and_dtype(requests).items():
            tensors = [t for i in members for t in requests[i].tensors]
            flag = torch.as_tensor(poison, dtype=dtype).reshape(1).to(tensors[0].device)
            flat = torch.cat([*(t.reshape(-1) for t in tensors), flag])
            traffic.add(self._add_counts(flat))
            pieces = iter(_split(flat[:-1], tensors))
            for i in members:
                answers[places[i]] = [next(pieces) for _ in requests[i].tensors]
            poisoned = merge_flags(poisoned, flat[-1] > 0)
        return poisoned

    def _add_counts(self, flat: Tensor) -> Traffic:
        """Sum the integer tensor ``flat`` over the ranks in place: a ring all-reduce."""
        self._collective(dist.all_reduce, flat)
        return _ring_allreduce_traffic(flat.numel() * flat.element_size(), self.world_size)

    def _gather_round(
        self, requests: Sequence[Request], poison: bool | Tensor, lazy: bool
    ) -> RoundResult:
        """Every request through one all-gather of this rank's framed bytes."""
        tensors = [t for request in requests for t in request.tensors]
        device = tensors[0].device if tensors else control_device(self.group)
        own = frame(tensors, poison, device)
        gathered = torch.empty(self.world_size * own.numel(), dtype=torch.uint8, device=device)
        self._gather(gathered, own)
        per_rank = gathered.view(self.world_size, own.numel())
        flags = per_rank[:, -1].any()
        poisoned: bool | Tensor = flags if lazy else bool(flags)
        traffic = _ring_allgather_traffic(own.numel(), self.world_size)
        # Decode every rank's tensors from its bytes, in request order.
        rank_tensors = [split_bytes(per_rank[r, :-1], tensors) for r in range(self.world_size)]
        answers: list[Any] = []
        offset = 0
        for request in requests:
            count = len(request.tensors)
            per_rank_payload = [rt[offset : offset + count] for rt in rank_tensors]
            offset += count
            if request.op is Op.GATHER:
                answers.append(per_rank_payload)
            else:
                answers.append(reduce_locally(request.op, per_rank_payload))
        return RoundResult(answers, poisoned, traffic)

    def _gather(self, gathered: Tensor, own: Tensor) -> None:
        """Fill ``gathered`` with every rank's ``own`` bytes, in rank order (a ring)."""
        self._collective(_all_gather_single, gathered, own)


class DirectCommunicator(AllGatherCommunicator):
    """The all-gather communicator in one step: an all-to-all of each rank's payload."""

    name = "direct"

    def _gather(self, gathered: Tensor, own: Tensor) -> None:
        """Send ``own`` to every rank at once; receive theirs into ``gathered``."""
        self._collective(dist.all_to_all_single, gathered, own.repeat(self.world_size))

    def _add_counts(self, flat: Tensor) -> Traffic:
        """Sum the integer tensor ``flat`` over the ranks in place, in one step: every rank
        sends it to every other, and each adds them up (one network delay instead of the
        ring's 2 (N - 1), for N - 1 copies of its bytes out and in)."""
        every = torch.empty(self.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        self._collective(dist.all_to_all_single, every, flat.repeat(self.world_size))
        torch.sum(every.view(self.world_size, -1), dim=0, out=flat)
        return _ring_allgather_traffic(flat.numel() * flat.element_size(), self.world_size)


COMMUNICATORS: dict[str, type[Communicator]] = {
    "allreduce": AllReduceCommunicator,
    "allgather": AllGatherCommunicator,
    "direct": DirectCommunicator,
}


def make_communicator(
    kind: str | Communicator, compressor: Compressor, group: dist.ProcessGroup | None = None
) -> Communicator:
    """Build the communicator named ``kind`` (``"auto"`` picks by the compressor's
    aggregation) and check that it can carry ``compressor``."""
    if isinstance(kind, Communicator):
        communicator = kind
    elif kind == "auto":
        summable = compressor.aggregation is Aggregation.SUM
        communicator = (AllReduceCommunicator if summable else AllGatherCommunicator)(group)
    elif kind in COMMUNICATORS:
        communicator = COMMUNICATORS[kind](group)
    else:
        known = ", ".join(["auto", *COMMUNICATORS])
        raise ValueError(f"unknown communicator {kind!r}; choose one of: {known}")
    communicator.check(compressor)
    return communicator


# -- helpers --------------------------------------------------------------------------------


def gathering_routes(requests: Sequence[Request]) -> dict[str, list[int]]:
    """Indices of ``requests`` by how a gathering communicator sends them: ``"scatter"``
    (an all-to-all), ``"count"`` (integer sums: an all-reduce, exact in any order) and
    ``"gather"`` (the rest: one all-gather)."""
    routes: dict[str, list[int]] = {"gather": [], "scatter": [], "count": []}
    for i, request in enumerate(requests):
        if request.op is Op.SCATTER:
            routes["scatter"].append(i)
        elif request.op is Op.SUM and not request.tensors[0].is_floating_point():
            routes["count"].append(i)
        else:
            routes["gather"].append(i)
    return routes


def group_by_op_and_dtype(requests: Sequence[Request]) -> dict[tuple[Op, torch.dtype], list[int]]:
    """Indices of ``requests`` by (op, dtype): the requests one fused all-reduce carries."""
    groups: dict[tuple[Op, torch.dtype], list[int]] = {}
    for i, request in enumerate(requests):
        dtypes = {t.dtype for t in request.tensors}
        if len(dtypes) != 1:
            raise TypeError(f"a {request.op.value} request mixes dtypes {sorted(map(str, dtypes))}")
        groups.setdefault((request.op, dtypes.pop()), []).append(i)
    return groups


def _flatten(tensors: Sequence[Tensor], dtype: torch.dtype, in_place: bool = False) -> Tensor:
    """``tensors`` in one flat buffer of ``dtype`` to reduce; ``in_place``: a single
    contiguous tensor of that dtype is the buffer itself (its owner reads it no more)."""
    if len(tensors) == 1:
        only = tensors[0]
        if in_place and only.dtype == dtype and only.is_contiguous():
            return only.view(-1)
        return only.reshape(-1).to(dtype, copy=True)
    return torch.cat([t.reshape(-1) for t in tensors])


def _split(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    if len(like) == 1:  # a whole bucket: no split (Tensor.split's Python costs more)
        only = like[0]
        return [flat.view(only.shape)]
    sizes = [t.numel() for t in like]
    pieces = flat.split_with_sizes(sizes)
    return [piece.view(t.shape) for piece, t in zip(pieces, like, strict=True)]


def reduce_locally(op: Op, per_rank: list[list[Tensor]]) -> list[Tensor]:
    """Sum (or take the maximum of) every rank's payload, in rank order, so that every
    rank that reduces the same gathered payloads computes the same bits."""
    out = [t.clone() for t in per_rank[0]]
    for payload in per_rank[1:]:
        for acc, t in zip(out, payload, strict=True):
            if op is Op.SUM:
                acc.add_(t)
            else:
                torch.maximum(acc, t, out=acc)
    return out


def _ring_allreduce_traffic(nbytes: int, world: int) -> Traffic:
    wire = 2 * (world - 1) * nbytes // world if world > 1 else 0
    return Traffic(payload=nbytes, sent=wire, received=wire, collectives=1)


def _ring_allgather_traffic(nbytes: int, world: int) -> Traffic:
    wire = (world - 1) * nbytes
    return Traffic(payload=nbytes, sent=wire, received=wire, collectives=1)


def run_collective(
    what: str, fn: Any, *args: Any, group: dist.ProcessGroup | None = None, **kwargs: Any
) -> Any:
    """Call the ``torch.distributed`` collective ``fn(*args, group=group, **kwargs)``; if it
    fails or times out (a peer died, diverged or stalled), raise
    :class:`~thinwire.errors.CommunicationError` naming ``what`` it was, this rank and the
    group's timeout, instead of the backend's bare message."""
    try:
        return fn(*args, group=group, **kwargs)
    except RuntimeError as error:
        raise CommunicationError(
            f"{what} on rank {dist.get_rank(group)} of {dist.get_world_size(group)} failed or "
            f"timed out (process group timeout: {group_timeout(group)}): a peer rank has "
            f"probably died, diverged or stalled; check the other ranks' output. ({error})"
        ) from error


def control_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where thinwire's small control tensors (settings checks, status bytes) must live for
    ``group``'s collectives: the CPU when its backend carries CPU tensors (gloo, MPI, or a
    ``cpu:gloo,cuda:nccl`` pair), else this process's current CUDA device (NCCL alone)."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def sibling_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """A new process group of ``group``'s ranks (default: every rank) with its collective
    timeout, for traffic that must not queue behind ``group``'s (a collective of every
    rank of the default group). ``new_group`` alone would fall back to the backend's
    default (30 minutes on gloo), so a dead peer would hang it far longer than the user
    asked for."""
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    timeout = group_timeout(group)
    try:
        return dist.new_group(ranks=ranks, timeout=timeout)
    except RuntimeError as error:
        raise CommunicationError(
            f"creating a process group on rank {dist.get_rank()} failed or timed out (timeout: "
            f"{timeout}): every rank must build the same thinwire wrappers and tables in the "
            "same order (each creates process groups, a collective of every rank), and no "
            f"peer may have died; check the other ranks' output. ({error})"
        ) from error


def group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta | None:
    """The process group's collective timeout (``None`` if unknown): for error messages and
    for the groups :func:`sibling_group` makes."""
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    holders = [lambda: pg]
    for kind in ("cpu", "cuda"):  # an NCCL-only group has no CPU backend, and says so by raising
        holders.append(lambda kind=kind: pg._get_backend(torch.device(kind)))
    for holder in holders:
        with contextlib.suppress(Exception):  # private API: its shape differs across versions
            return holder().options._timeout  # type: ignore[union-attr]
    return None
