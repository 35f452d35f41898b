"""How each method exchanges one DDP-style bucket, replayed in this process without peers.

:func:`build_exchanger`: a method's :data:`~thinwire.plan.profile_buckets.Exchanger`:
DDP's all-reduce, PyTorch's own ``fp16_compress_hook`` and ``powerSGD_hook`` called on the
bucket (:mod:`thinwire.plan.profile_torch_hooks`), or thinwire's own exchange engine
(:class:`ThinwireEngine`: memory, protocols, rounds fused across buckets) on a local
communicator.

No ``torch.distributed`` process group is needed: collectives are answered locally (a sum
is ``world_size`` copies of this rank's payload, a gather ``world_size`` payloads), and
what they would have sent is recorded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from thinwire.comm.collectives import (
    Communicator,
    RoundResult,
    gathering_routes,
    group_by_op_and_dtype,
)
from thinwire.comm.engine import GradientExchange, GradientItem
from thinwire.compress.base import Aggregation, Compressor, Op, Request
from thinwire.plan.network import ALLGATHER, ALLREDUCE, ALLTOALL, PACED, Collective
from thinwire.plan.profile_buckets import Bucket, Exchanger
from thinwire.plan.profile_torch_hooks import TorchHook
from thinwire.strategies.compressed import split_communicator


def build_exchanger(
    costing: str, method: str, options: Mapping[str, Any], world: int, fuse_rounds: bool
) -> Exchanger:
    """The :data:`Exchanger` of ``method`` (its strategy's ``costing``, with ``options``)
    for ``world`` workers: DDP's plain all-reduce, PyTorch's fp16 or PowerSGD hook, or a
    thinwire compressor through :class:`ThinwireEngine` (``fuse_rounds``: see that class)."""
    if costing == "dense":
        return lambda bucket, run, last: [Collective(ALLREDUCE, bucket.numel * 4)]
    if costing == "torch-fp16":
        return TorchHook.fp16(world)
    if costing == "torch-powersgd":
        return TorchHook.powersgd(options, world)
    from thinwire.compress.registry import compressor as build

    options_of_compressor, communicator = split_communicator(options)
    return ThinwireEngine(build(method, **options_of_compressor), world, fuse_rounds, communicator)


class _LocalCommunicator(Communicator):
    """A communicator without peers: answers each round as if every rank had sent this
    rank's payload, and records the collectives the real one (``kind``: all-reduce,
    all-gather or direct) would issue: one all-gather or all-to-all of every request plus a
    status byte, or one all-reduce per (op, dtype)."""

    checks_start = False  # no peers to agree with

    def __init__(self, world: int, kind: str) -> None:  # no process group needed
        super().__init__(world_size=world, rank=0)
        self.kind = kind
        self.name = kind
        #: what the rounds since it was last emptied would have sent
        self.sent: list[Collective] = []
        #: how many of ``sent`` each of those rounds issued, in order
        self.rounds: list[int] = []

    def supports(self, op: Op) -> bool:
        """Everything when gathering; sums and maxima under all-reduce."""
        return self.kind != ALLREDUCE or op in (Op.SUM, Op.MAX)

    def _execute(
        self, requests: Sequence[Request], poison: bool | Tensor, lazy: bool
    ) -> RoundResult:
        before = len(self.sent)
        if self.kind != ALLREDUCE:
            self._record_gathering(requests)
        else:
            for (_, dtype), members in group_by_op_and_dtype(requests).items():
                numel = sum(t.numel() for i in members for t in requests[i].tensors)
                self.sent.append(Collective(ALLREDUCE, numel * dtype.itemsize))
        self.rounds.append(len(self.sent) - before)
        return RoundResult([_answer(r, self.world_size) for r in requests], poisoned=False)

    def _record_gathering(self, requests: Sequence[Request]) -> None:
        """What the all-gather and direct communicators send for ``requests``: scatters in
        an all-to-all (the rows addressed to the others, and their lengths), integer sums
        in an all-reduce (all-gather) or a direct round, the rest in one gather."""
        routes = gathering_routes(requests)
        scatters = [requests[i] for i in routes["scatter"]]
        counts = [requests[i] for i in routes["count"]]
        rest = [requests[i] for i in routes["gather"]]
        if rest or not (scatters or counts):
            payload = sum(_nbytes(t) for r in rest for t in r.tensors)
            self.sent.append(Collective(self.kind, payload + 1))
        if scatters:
            own = sum(_nbytes(t[: r.counts[0]]) for r in scatters for t in r.tensors)
            total = sum(_nbytes(t) for r in scatters for t in r.tensors)
            # every rank's lengths and pacing budget, to each peer
            lengths = 8 * (self.world_size + 1) * (self.world_size - 1)
            self.sent.append(Collective(ALLTOALL, lengths))
            self.sent.append(Collective(PACED, total - own + self.world_size - 1))
        if counts:
            numel = sum(t.numel() for r in counts for t in r.tensors) + 1
            kind = ALLREDUCE if self.kind == ALLGATHER else self.kind
            self.sent.append(Collective(kind, numel * counts[0].tensors[0].element_size()))


class ThinwireEngine:
    """thinwire's own exchange engine on a :class:`_LocalCommunicator`: the real memory,
    protocols and schedule (rounds fused across buckets as the DDP hook and
    ``DistributedOptimizer`` do, or each bucket's alone as DGA and the parameter server
    do), with collectives recorded, not sent."""

    def __init__(
        self, compressor: Compressor, world: int, fuse_rounds: bool, communicator: str = "auto"
    ) -> None:
        if communicator == "auto":
            summable = compressor.aggregation is Aggregation.SUM
            communicator = ALLREDUCE if summable else ALLGATHER
        self.communicator = _LocalCommunicator(world, communicator)
        self.engine = GradientExchange(compressor, communicator=self.communicator, history=1)
        #: the first step measured: past any density warm-up
        self.first_step = int(getattr(compressor, "warmup_steps", 0) or 0)
        self.fuse_rounds = fuse_rounds

    def __call__(self, bucket: Bucket, run: int, last: bool) -> list[Collective]:
        items = [
            GradientItem(name, view, param)
            for name, view, param in zip(bucket.names, bucket.views, bucket.params, strict=True)
        ]
        self.communicator.sent, self.communicator.rounds = [], []
        step = self.first_step + run
        for done, means in self.engine.exchange_bucket(
            items, bucket, last=last, fuse=self.fuse_rounds, step=step
        ):
            done.store(means)
        return self.communicator.sent

    @property
    def last_rounds(self) -> tuple[int, ...]:
        """How many collectives each round of the last call issued, in order."""
        return tuple(self.communicator.rounds)


def _answer(request: Request, world: int) -> Any:
    """What the collective would return if every rank had sent this rank's payload."""
    if request.op is Op.GATHER:
        return [list(request.tensors)] * world
    if request.op is Op.SCATTER:  # from every rank, the rows this one (rank 0) sent itself
        own = request.counts[0] if request.counts else 0
        return [torch.cat([t[:own]] * world) for t in request.tensors]
    if request.op is Op.SUM:
        return [t * world for t in request.tensors]
    return [t.clone() for t in request.tensors]


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()
