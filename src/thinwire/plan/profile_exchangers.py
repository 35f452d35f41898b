"""How each method exchanges one DDP-style bucket, replayed in this process without peers.

- :class:`Bucket`: a flat fp32 buffer with a view per parameter, as a DDP hook sees it.
- :func:`build_exchanger`: a method's :data:`Exchanger`: DDP's all-reduce, a copy of
  PyTorch's ``fp16_compress_hook`` and ``powerSGD_hook`` tensor math, or thinwire's own
  exchange engine (:class:`ThinwireEngine`: memory, protocols, rounds fused across
  buckets) on a local communicator.

No ``torch.distributed`` process group is needed: collectives are answered locally (a sum
is ``world_size`` copies of this rank's payload, a gather ``world_size`` payloads), and
what they would have sent is recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from thinwire.comm.collectives import Communicator, RoundResult, group_by_op_and_dtype
from thinwire.comm.engine import GradientExchange, GradientItem
from thinwire.compress.base import Aggregation, Compressor, Op, Request
from thinwire.plan.network import ALLGATHER, ALLREDUCE, Collective
from thinwire.strategies.compressed import split_communicator


class Bucket:
    """A DDP-style bucket: one flat fp32 buffer, a view per parameter."""

    def __init__(self, index: int, params: Sequence[tuple[str, Tensor]]) -> None:
        self.index = index
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.numel = sum(p.numel() for p in self.params)
        self.buffer = torch.empty(self.numel, dtype=torch.float32)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()

    def fill(self, generator: torch.Generator) -> None:
        """Fresh random gradients (small, like real ones)."""
        self.buffer.copy_(torch.randn(self.numel, generator=generator)).mul_(1e-3)

    def store(self, means: Sequence[Tensor]) -> None:
        """Write the averaged gradients into the bucket, as a DDP hook's future does."""
        for view, mean in zip(self.views, means, strict=True):
            view.copy_(mean)


#: exchanges one bucket: ``(bucket, run, last)`` -> the collectives it issued (``run``: the
#: step's index; ``last``: the step's last bucket); the averaged gradients land in the bucket
Exchanger = Callable[[Bucket, int, bool], list[Collective]]


def build_exchanger(
    costing: str, method: str, options: Mapping[str, Any], world: int, fuse_rounds: bool
) -> Exchanger:
    """The :data:`Exchanger` of ``method`` (its strategy's ``costing``, with ``options``)
    for ``world`` workers: DDP's plain all-reduce, PyTorch's fp16 or PowerSGD hook, or a
    thinwire compressor through :class:`ThinwireEngine` (``fuse_rounds``: see that class)."""
    if costing == "dense":
        return lambda bucket, run, last: [Collective(ALLREDUCE, bucket.numel * 4)]
    if costing == "torch-fp16":
        return lambda bucket, run, last: _fp16_hook(bucket, world)
    if costing == "torch-powersgd":
        return _TorchPowerSGD(options, world)
    from thinwire.compress.registry import compressor as build

    options_of_compressor, communicator = split_communicator(options)
    return ThinwireEngine(build(method, **options_of_compressor), world, fuse_rounds, communicator)


def _fp16_hook(bucket: Bucket, world: int) -> list[Collective]:
    """What ``fp16_compress_hook`` does around its all-reduce."""
    half = bucket.buffer.to(torch.float16).div_(world)
    bucket.buffer.copy_(half)
    return [Collective(ALLREDUCE, half.numel() * half.element_size())]


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

    def supports(self, op: Op) -> bool:
        """Everything when gathering; sums and maxima under all-reduce."""
        return self.kind != ALLREDUCE or op in (Op.SUM, Op.MAX)

    def _execute(self, requests: Sequence[Request], poison: bool) -> RoundResult:
        if self.kind != ALLREDUCE:
            payload = sum(_nbytes(t) for r in requests for t in r.tensors)
            self.sent.append(Collective(self.kind, payload + 1))
        else:
            for (_, dtype), members in group_by_op_and_dtype(requests).items():
                numel = sum(t.numel() for i in members for t in requests[i].tensors)
                self.sent.append(Collective(ALLREDUCE, numel * dtype.itemsize))
        return RoundResult([_answer(r, self.world_size) for r in requests], poisoned=False)


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
        self.communicator.sent = []
        step = self.first_step + run
        for done, means in self.engine.exchange_bucket(
            items, bucket, last=last, fuse=self.fuse_rounds, step=step
        ):
            done.store(means)
        return self.communicator.sent


def _answer(request: Request, world: int) -> Any:
    """What the collective would return if every rank had sent this rank's payload."""
    if request.op is Op.GATHER:
        return [list(request.tensors)] * world
    if request.op is Op.SUM:
        return [t * world for t in request.tensors]
    return [t.clone() for t in request.tensors]


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _TorchPowerSGD:
    """The tensor math of PyTorch's ``powerSGD_hook`` past ``start_powerSGD_iter`` (error
    feedback, warm start), with its three chained all-reduces per bucket: the uncompressed
    tensors, the P factors, the Q factors (empty ones are not counted)."""

    def __init__(self, options: Mapping[str, Any], world: int) -> None:
        self.rank = int(options["matrix_approximation_rank"])
        self.min_rate = float(options.get("min_compression_rate", 2))
        self.error_feedback = bool(options.get("use_error_feedback", True))
        self.warm_start = bool(options.get("warm_start", True))
        self.epsilon = float(options.get("orthogonalization_epsilon", 0))
        self.world = world
        self.errors: dict[int, Tensor] = {}
        self.qs: dict[int, Tensor] = {}

    def __call__(self, bucket: Bucket, run: int, last: bool) -> list[Collective]:
        buffer = bucket.buffer
        copy = None
        if self.error_feedback:
            if bucket.index in self.errors:
                buffer.add_(self.errors[bucket.index])
            copy = buffer.clone()
        matrices, plain = [], []
        for view in bucket.views:
            n = view.shape[0] if view.dim() else 1
            m = view.numel() // max(n, 1)
            r = min(n, m, self.rank)
            if (n + m) * r * self.min_rate < n * m:
                matrices.append((view.reshape(1, n, m), r))
            else:
                plain.append(view)
        flat_plain = torch.cat([t.reshape(-1) for t in plain]) if plain else buffer[:0]
        p_size = sum(mat.shape[1] * r for mat, r in matrices)
        q_size = sum(mat.shape[2] * r for mat, r in matrices)
        q_memory = self.qs.get(bucket.index)
        if q_memory is None or not self.warm_start:
            q_memory = torch.randn(q_size)
        p_memory = torch.empty(p_size)
        ps, qs, p_at, q_at = [], [], 0, 0
        for mat, r in matrices:
            _, n, m = mat.shape
            ps.append(p_memory[p_at : p_at + n * r].view(1, n, r))
            qs.append(q_memory[q_at : q_at + m * r].view(1, m, r))
            p_at, q_at = p_at + n * r, q_at + m * r
        for q in qs:
            _orthogonalize(q, self.epsilon)
        for (mat, _), q, p in zip(matrices, qs, ps, strict=True):
            torch.bmm(mat, q, out=p)
        flat_plain.mul_(self.world).div_(self.world)  # the summed uncompressed tensors
        offset = 0
        for t in plain:
            t.copy_(flat_plain[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        p_memory.mul_(self.world)  # the summed P
        for p in ps:
            _orthogonalize(p, self.epsilon)
        for (mat, _), p, q in zip(matrices, ps, qs, strict=True):
            torch.bmm(mat.transpose(1, 2), p, out=q)
        q_memory.mul_(self.world).div_(self.world)  # the summed Q, averaged
        for (mat, _), p, q in zip(matrices, ps, qs, strict=True):
            torch.bmm(p, q.transpose(1, 2), out=mat)
        if copy is not None:
            self.errors[bucket.index] = copy - buffer
        self.qs[bucket.index] = q_memory
        sizes = (flat_plain.numel() * 4, p_size * 4, q_size * 4)
        return [Collective(ALLREDUCE, nbytes) for nbytes in sizes if nbytes]


def _orthogonalize(matrices: Tensor, epsilon: float) -> None:
    """PyTorch's own orthogonalisation (Gram-Schmidt for rank <= 2, QR above)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    powerSGD_hook._orthogonalize(matrices, epsilon)
