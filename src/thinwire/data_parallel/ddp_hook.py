"""The DDP front end: ``thinwire.register(ddp_model, "dgc", density=0.001)``.

(No ``from __future__ import annotations`` here: DDP inspects the hook's annotations.)

DDP calls a communication hook once per gradient bucket, in bucket order on every rank, and
waits for the returned futures at the end of the backward pass. thinwire's hook queues the
bucket's exchange on the engine's ordered thread and returns at once, so compression and
communication of early buckets overlap the rest of the backward pass. The future resolves
to the bucket buffer holding the averaged gradients. The last bucket closes the step
(statistics, counter, committed error feedback) before any of the step's remaining futures
resolves, so that when ``backward()`` returns, ``engine.last_step``, ``engine.step`` and
``engine.state_dict()`` already describe the step just taken.

With ``fuse_rounds`` (the default), a compressor that needs several rounds per bucket
(PowerSGD's P and Q, TernGrad's scaler and codes) sends bucket i's later rounds in the same
collectives as bucket i+1's first (:meth:`GradientExchange.exchange_fused`): about half the
collectives, each with its fixed cost of latency, at the price of bucket i finishing when
bucket i+1 is ready, which DDP only needs by the end of the backward pass. One-round
compressors are not affected.

A bucket whose exchange fails (a non-finite gradient on some rank, a lost peer) fails the
step on every rank: the engine puts its memory back as before the step, and the buckets
DDP hands over after it, up to the last, fail with the same error without exchanging
anything, so that nothing of the refused step is kept and every rank issues the same
collectives. On a GPU the finiteness verdicts travel as device flags (reading one would
make the host wait for the GPU, once per bucket): every bucket is exchanged, and the
step's last bucket reads all the flags at once and fails the step there, with the same
outcome (``GradientExchange.defer_verdicts``).
"""

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from thinwire.comm.collectives import Communicator, sibling_group
from thinwire.comm.device_refusal import check_refusal, device_refusal
from thinwire.comm.engine import GradientExchange, GradientItem
from thinwire.comm.survey import KeptItems
from thinwire.compress.base import Compressor, Memory, check_flag
from thinwire.compress.registry import compressor as build_compressor


@dataclass
class HookState:
    """What the hook needs: the engine, each parameter's name by identity, whether rounds
    are fused across buckets, and the futures of buckets still in flight."""

    engine: GradientExchange
    names: dict[int, str]
    fuse_rounds: bool = True
    waiting: list[torch.futures.Future] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: the error that failed a bucket of the step under way (used on the exchange thread)
    failed: BaseException | None = None
    #: per bucket index: (buffer address and size, parameter ids), views, items, and
    #: whether the items are in the buffer's order (the buffer is then one flat run)
    layouts: dict[int, tuple[Any, list[torch.Tensor], list[GradientItem], bool]] = field(
        default_factory=dict
    )

    def layout(
        self, bucket: dist.GradBucket, buffer: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[GradientItem], bool]:
        """The views of ``buffer`` that are its parameters' gradients, the engine's items
        for them, and whether they are in the buffer's order; kept per bucket while DDP
        hands the same buffer and parameters (after its first step it rebuilds its buckets
        once, then keeps them). A run resumed from a checkpoint exchanges its first step's
        buckets (DDP's first layout, before the rebuild) in the order the checkpoint's run
        used, so that sums are taken in the same order: the same bits."""
        params = bucket.parameters()
        index = bucket.index()
        signature = (buffer.data_ptr(), buffer.numel(), tuple(id(p) for p in params))
        known = self.layouts.get(index)
        if known is not None and known[0] == signature:
            return known[1], known[2], known[3]
        views, offset = [], 0
        for param in params:
            views.append(buffer[offset : offset + param.numel()].view(param.shape))
            offset += param.numel()
        names = [self.names[id(p)] for p in params]
        order = list(range(len(params)))
        restored = self.engine.restored_bucket_orders.pop(index, None)
        if restored is not None and sorted(restored) == sorted(names):
            position = {name: i for i, name in enumerate(restored)}
            order.sort(key=lambda i: position[names[i]])
        views = [views[i] for i in order]
        items = KeptItems(GradientItem(names[i], views[k], params[i]) for k, i in enumerate(order))
        in_buffer_order = order == sorted(order)
        self.engine.bucket_orders[index] = [names[i] for i in order]
        self.layouts[index] = (signature, views, items, in_buffer_order)
        return views, items, in_buffer_order

    def earlier_failure(self, is_last: bool) -> BaseException | None:
        """The error that failed an earlier bucket of this step, if one did: this bucket
        must then not be exchanged (the step is not taken). The last bucket ends the step."""
        error = self.failed
        if is_last:
            self.failed = None
        return error

    def fail(self, error: BaseException, is_last: bool) -> None:
        """Remember that this step failed, for the buckets after this one."""
        if not is_last:
            self.failed = error


def register(
    model: DistributedDataParallel,
    compressor: str | Compressor = "none",
    *,
    communicator: str | Communicator = "auto",
    optimizer: torch.optim.Optimizer | None = None,
    memory: Memory | None = None,
    fuse_rounds: bool = True,
    refusal: str = "auto",
    **options: Any,
) -> GradientExchange:
    """Make ``model`` (a DDP module) exchange gradients through ``compressor``.

    Args:
        model: a ``DistributedDataParallel`` model, before its first backward pass.
        compressor: a registered name (``thinwire.compressors()`` lists them) or an instance.
        communicator: ``"auto"``, ``"allreduce"``, ``"allgather"`` or ``"direct"``.
        optimizer: if given, checked against the compressor (DGC applies momentum itself,
            so an optimizer that adds its own momentum is refused with an explanation).
        memory: override the compressor's default error-feedback memory.
        fuse_rounds: send each bucket's later rounds with the next bucket's first (fewer
            collectives; see the module docstring). ``False``: each bucket's rounds alone.
        refusal: how a step with a NaN or Inf gradient on some rank is refused on a GPU.
            ``"host"``: the verdict is read once a step (one host wait) and every rank
            raises :class:`~thinwire.errors.NonFiniteGradientError` at that step.
            ``"device"``: it stays on the GPU (no host wait): ``optimizer`` (a fused one,
            ``fused=True``) skips the step there, thinwire's state is put back there, and
            a :class:`~thinwire.errors.NonFiniteGradientWarning` reports it once the host
            sees it (from the optimizer's second step on; the first is read on the host).
            ``"auto"`` (default): ``"device"`` where ``optimizer`` is a fused one and the
            compressor can undo a step on the device, else ``"host"``. On the CPU the
            verdict is read at once either way (no wait to save).
        **options: compressor options when ``compressor`` is a name (e.g. ``density``).

    Returns:
        The :class:`GradientExchange` engine: per-step statistics (``last_step``,
        ``history``) and ``state_dict()``/``load_state_dict()`` for checkpoints.
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"register() needs a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(model).__name__}; wrap it with DDP first, or use "
            "thinwire.DistributedOptimizer for code without DDP"
        )
    if getattr(model, "mixed_precision", None) is not None:
        raise RuntimeError(
            "this DDP model was built with mixed_precision=, for which DDP registers a "
            "communication hook of its own, and DDP takes one per model: build DDP without "
            "mixed_precision (thinwire's fp16/bf16 compressors send half-precision "
            "gradients), or use thinwire.DistributedOptimizer"
        )
    if getattr(model, "_comm_hooks", None):
        raise RuntimeError(
            "this DDP model already has a communication hook (from thinwire.register or "
            "register_comm_hook), and DDP takes one per model: build a new "
            "DistributedDataParallel around the module to exchange through another compressor"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer (to check it against the compressor), "
            f"got {type(optimizer).__name__}"
        )
    check_flag("fuse_rounds", fuse_rounds)
    check_refusal(refusal)  # before anything is built
    built = build_compressor(compressor, **options)
    if optimizer is not None:
        built.check_optimizer(optimizer)
    group = getattr(model, "process_group", None)
    if group is not None and group is dist.GroupMember.WORLD:
        group = None
    # The exchange thread's collectives get a process group of their own: DDP issues some
    # on the model's group from the autograd thread while buckets are still in flight
    # (with find_unused_parameters, an all-reduce of the used-parameter map right after
    # the last bucket's hook), and two threads on one group would not keep one order.
    engine = GradientExchange(
        built, communicator=communicator, memory=memory, group=sibling_group(group)
    )
    # the parameters DDP buckets (those frozen after DDP was built included), less those
    # DDP leaves alone (thinwire.data_parallel.sparse's tables: each rank's shard differs by design)
    ignored = set(getattr(model, "parameters_to_ignore", ()))
    named = [(n, p) for n, p in model.module.named_parameters() if n not in ignored]
    engine.verify(named)
    engine.device_refusal = device_refusal(refusal, optimizer, engine)
    state = HookState(engine, {id(p): n for n, p in named}, fuse_rounds=fuse_rounds)
    model.register_comm_hook(state, compressed_hook)
    return engine


def compressed_hook(
    state: HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average one bucket through the engine, asynchronously."""
    buffer = bucket.buffer()
    views, items, in_buffer_order = state.layout(bucket, buffer)
    whole = buffer if in_buffer_order else None
    is_last = bucket.is_last()
    engine = state.engine
    if not state.fuse_rounds:

        def job() -> torch.Tensor:
            earlier = state.earlier_failure(is_last)
            if earlier is not None:
                raise earlier
            try:
                ((_, means),) = engine.exchange_bucket(items, last=is_last, whole=whole)
            except BaseException as error:
                state.fail(error, is_last)
                raise
            return _into_bucket(buffer, views, means, in_buffer_order)

        return _for_ddp(engine.submit(job, here=is_last))

    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    with state.lock:
        state.waiting.append(future)

    def fused_job() -> None:
        earlier = state.earlier_failure(is_last)
        if earlier is not None:  # fail this bucket alone: DDP may be on its next step
            with state.lock:
                if future in state.waiting:
                    state.waiting.remove(future)
            if not future.done():
                future.set_exception(earlier)
            return
        try:
            try:
                finished = engine.exchange_bucket(
                    items,
                    (views, buffer, future, in_buffer_order),
                    last=is_last,
                    fuse=True,
                    whole=whole,
                )  # with the last bucket, the step is closed before any future resolves
            except BaseException as error:
                state.fail(error, is_last)
                raise
            results = [_into_bucket(b, v, means, o) for (v, b, _, o), means in finished]
            tokens = (token for token, _ in finished)
            for (_, _, done_future, _), result in zip(tokens, results, strict=True):
                with state.lock:
                    state.waiting.remove(done_future)
                done_future.set_result(result)
        except BaseException as error:  # every bucket still waiting would wait forever
            with state.lock:
                failed, state.waiting[:] = list(state.waiting), []
            for waiting in failed:
                waiting.set_exception(error)
            raise

    engine.submit(fused_job, here=is_last)  # DDP waits for the last bucket: run it here
    return _for_ddp(future)


def _into_bucket(
    buffer: torch.Tensor, views: list[torch.Tensor], means: Any, in_buffer_order: bool
) -> torch.Tensor:
    """What DDP gets for a bucket: the engine's flat mean itself when it covers the bucket
    in the buffer's order (DDP copies it into the gradients, as it does the result of its
    own all-reduce), else ``buffer`` with each run's flat mean put into its places, or
    each mean copied into its view."""
    flat = getattr(means, "flat", None) if in_buffer_order else None
    if flat is not None and flat.shape == buffer.shape and flat.dtype == buffer.dtype:
        return flat
    pieces = means.pieces() if in_buffer_order and hasattr(means, "pieces") else None
    if pieces is not None and buffer.dtype == pieces[0][1].dtype:
        for positions, mean in pieces:  # each run's mean into its places, at once
            buffer.index_copy_(0, positions, mean)
        return buffer
    for view, mean in zip(views, means, strict=True):
        view.copy_(mean)
    return buffer


def _for_ddp(future: torch.futures.Future) -> torch.futures.Future:
    """``future``, chained so that its failure reaches DDP as an error: DDP's reducer (C++)
    cannot read an exception set from Python as a result ("Unable to cast ... to Tensor").
    Its ``backward()`` then raises a RuntimeError whose message contains the name and
    message of thinwire's error (``... NonFiniteGradientError: ...``)."""
    return future.then(lambda done: done.value())
