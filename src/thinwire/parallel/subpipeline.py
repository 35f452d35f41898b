"""Sub-pipelined tensor parallelism (Merak's third technique): a stage's blocks run each
micro-batch as ``n`` sub-batches taking turns, so that the all-reduce one sub-batch waits
for overlaps the compute of the next.

Under tensor parallelism every block waits twice in the forward (after attention's
output projection and after the MLP's down projection, PyTorch's ``RowwiseParallel``) and
again in the backward (the input gradients of the column-parallel projections). Here each
sub-batch runs the stage's blocks in a thread of its own, and the threads take strict
turns: a thread computes until it must wait for a collective, hands the turn to the next
sub-batch, waits, and takes its turn again when it comes round. The collectives
themselves start when they are issued (``torch.distributed``'s functional collectives and
gloo's work threads), so the link carries one sub-batch's all-reduce while the processor
computes the next's. Nothing in the blocks changes: this works for any block whose
collectives are ``torch.distributed`` functional ones (thinwire's GPT and Llama-style
blocks, Hugging Face's Llama).

The turns are a fixed round robin, not first-come: every rank of the ``"tp"`` group
issues its collectives in the same order, whatever the timing. The backward runs the
sub-batches' graphs the same way, each in its turn, and returns the parameters' gradients
summed over the sub-batches (nothing is accumulated behind autograd's back).

Each sub-batch draws from a random stream of its own (the CPU generator's state is
swapped at every change of turn): in the forward, streams seeded from one draw of the
caller's generator, so dropout masks differ from an unsplit run's (each sample's math is
otherwise the same) but not from run to run; a checkpointed segment recomputed inside a
sub-batch's turns replays its own stream exactly. On CUDA the autograd
engine runs every backward on one device thread, where turns would deadlock: sub-batches
run on CPU ranks (gloo) in this version.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from thinwire.comm.worker import OrderedWorker

_WAIT = "_c10d_functional.wait_tensor.default"


class _StoppedError(RuntimeError):
    """A sub-batch stopped because another one failed (that one's error is raised)."""


class _Turns:
    """A strict round robin among workers ``0 .. n - 1``; a finished worker leaves it."""

    def __init__(self, workers: int, streams: list[Tensor]) -> None:
        self.order = list(range(workers))
        self.streams = streams
        """Each worker's random generator state while it does not hold the turn."""
        self.position = 0
        self.failed: BaseException | None = None
        self.changed = threading.Condition()

    def take(self, worker: int) -> None:
        """Block until it is ``worker``'s turn (or another worker failed)."""
        with self.changed:
            self.changed.wait_for(
                lambda: self.failed is not None or self.order[self.position] == worker
            )
            if self.failed is not None:
                raise _StoppedError("another sub-batch failed") from self.failed
        torch.set_rng_state(self.streams[worker])

    def hand_on(self, worker: int) -> None:
        """``worker`` is waiting: the next worker in the round computes."""
        self.streams[worker] = torch.get_rng_state()
        with self.changed:
            self.position = (self.order.index(worker) + 1) % len(self.order)
            self.changed.notify_all()

    def leave(self, worker: int, error: BaseException | None = None) -> None:
        """``worker`` is done (or failed with ``error``, which stops the others)."""
        with self.changed:
            if error is not None and self.failed is None:
                self.failed = error
            index = self.order.index(worker)
            self.order.pop(index)
            self.position = index % len(self.order) if self.order else 0
            self.changed.notify_all()


class _YieldAtWaits(TorchDispatchMode):
    """Hands the turn on whenever its worker is about to wait for a collective: an
    explicit ``wait_tensor`` or an operation reading a collective's unfinished result."""

    def __init__(self, turns: _Turns, worker: int) -> None:
        super().__init__()
        self.turns, self.worker = turns, worker

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        pending = [
            a
            for a in tree_leaves((args, kwargs))
            if isinstance(a, AsyncCollectiveTensor) and not a.completed
        ]
        if str(func) != _WAIT and not pending:
            return func(*args, **kwargs)
        self.turns.hand_on(self.worker)
        try:
            for tensor in pending:
                tensor.wait()
            result = func(*args, **kwargs)
        finally:
            self.turns.take(self.worker)
        return result


def in_turns(jobs: Sequence[Callable[[], Any]], fresh_streams: bool = False) -> list[Any]:
    """Run ``jobs`` in threads of their own taking strict turns between collectives
    (job 0 first); their results in order. The first error is raised once all stopped.

    Each job draws from its own random stream: with ``fresh_streams`` seeded from one
    draw of the caller's generator, else each starting from the caller's state, which is
    left as it was."""
    if fresh_streams:
        seeds = torch.randint(0, 2**62, (len(jobs),)).tolist()
        streams = [torch.Generator().manual_seed(seed).get_state() for seed in seeds]
    else:
        streams = [torch.get_rng_state()] * len(jobs)
    after = torch.get_rng_state()
    try:
        return _run_in_turns(jobs, _Turns(len(jobs), streams))
    finally:
        torch.set_rng_state(after)


def _run_in_turns(jobs: Sequence[Callable[[], Any]], turns: _Turns) -> list[Any]:
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException | None] = [None] * len(jobs)
    grad, autocast, hooks = torch.is_grad_enabled(), _autocast_state(), _saved_tensor_hooks()

    def work(worker: int) -> None:
        error: BaseException | None = None
        try:
            turns.take(worker)
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(grad))
                stack.enter_context(_autocast(autocast))
                if hooks is not None:
                    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*hooks))
                stack.enter_context(_YieldAtWaits(turns, worker))
                results[worker] = jobs[worker]()
        except BaseException as caught:  # handed to the caller below
            error = caught
        turns.leave(worker, error)
        if error is not None:
            errors[worker] = error

    _workers().run([lambda i=i: work(i) for i in range(len(jobs))])
    first = next((e for e in errors if e is not None and not isinstance(e, _StoppedError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


class _Workers:
    """Long-lived threads (:class:`~thinwire.comm.worker.OrderedWorker`), one per sub-batch
    position, that run the sub-batches' jobs call after call. Reused, not started per
    micro-batch: DTensor caches its sharding decisions per thread (``LocalLRUCache``), so
    fresh threads worked every operation's sharding out again (a Llama plan 2x2x2 on 8
    gloo ranks stepped 7.4x slower in 2 sub-batches than without; 3.2x with the threads
    kept). They stop when the thread that owns them ends (its thread-local data goes, and
    with it this object) and, as every ``OrderedWorker``, when the default process group
    is destroyed (the next call starts new ones) and at interpreter exit, before C++ tears
    down what they hold (a daemon thread left running there aborted the process in 1 exit
    of 4)."""

    def __init__(self) -> None:
        self.workers: list[OrderedWorker] = []
        weakref.finalize(self, _close, self.workers)

    def run(self, tasks: Sequence[Callable[[], None]]) -> None:
        """Run ``tasks[i]`` on thread ``i``, all at once; return when every one has."""
        for i, worker in enumerate(self.workers):
            if worker.closed:  # by a destroyed process group: a fresh thread in its place
                self.workers[i] = OrderedWorker(f"thinwire-subbatch-{i}")
        while len(self.workers) < len(tasks):
            self.workers.append(OrderedWorker(f"thinwire-subbatch-{len(self.workers)}"))
        done = [worker.submit(task) for worker, task in zip(self.workers, tasks, strict=False)]
        for future in done:
            future.wait()  # a task catches its own errors (``_run_in_turns``)


def _close(workers: list[OrderedWorker]) -> None:
    for worker in workers:
        worker.close(timeout=5.0)


_owned = threading.local()


def _forget_workers_after_fork() -> None:
    """A forked child has none of its parent's threads: it starts its own workers (jobs
    put in the parent's inboxes would wait forever)."""
    global _owned
    _owned = threading.local()


os.register_at_fork(after_in_child=_forget_workers_after_fork)


def _workers() -> _Workers:
    """The calling thread's workers (a sub-batch's own recomputation in turns, started from
    a worker thread, gets workers of its own: no thread waits on itself)."""
    workers = getattr(_owned, "workers", None)
    if workers is None:
        workers = _owned.workers = _Workers()
    return workers


def _saved_tensor_hooks() -> tuple[Callable, Callable] | None:
    """The caller's innermost ``saved_tensors_hooks`` (thread-local in PyTorch: a memory
    probe's or an offloading hook must see the sub-batches' saved tensors too)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    kinds = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    return [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds]


class _autocast:  # noqa: N801 - a context manager, named like torch.autocast
    """The autocast state of the calling thread, entered in a worker thread."""

    def __init__(self, state: list[tuple[str, bool, torch.dtype]]) -> None:
        self.managers = [torch.autocast(k, dtype=d, enabled=e) for k, e, d in state]

    def __enter__(self) -> None:
        for manager in self.managers:
            manager.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for manager in reversed(self.managers):
            manager.__exit__(*exc)


def split_batch(x: Tensor, parts: int) -> tuple[Tensor, ...]:
    """``x`` cut into ``parts`` equal sub-batches along its first dimension, or an error
    saying which sizes work."""
    if x.shape[0] % parts:
        raise ValueError(
            f"a micro-batch of {x.shape[0]} sequences does not split into subbatches={parts} "
            "equal sub-batches: use a micro-batch size (batch / (dp * microbatches)) that is "
            f"a multiple of {parts}, or fewer sub-batches"
        )
    return x.chunk(parts)


class SubBatches:
    """Runs a stage's blocks on ``parts`` sub-batches in turns (see the module's docstring)."""

    def __init__(self, parts: int) -> None:
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise ValueError(f"subbatches must be an integer >= 1, got {parts!r}")
        self.parts = parts

    def run(
        self, blocks: Callable[[Tensor], Tensor], x: Tensor, parameters: Sequence[Tensor]
    ) -> Tensor:
        """``blocks(x)``, computed sub-batch by sub-batch in turns (``parameters``: those
        ``blocks`` uses, whose gradients the backward returns)."""
        if self.parts == 1 or x.device.type == "meta":
            return blocks(x)
        if x.is_cuda:
            raise NotImplementedError(
                "sub-batches (subbatches > 1) run on CPU ranks in this version: the CUDA "
                "autograd engine runs backward passes on one device thread, where the "
                "sub-batches' turns would deadlock. Use subbatches=1 on GPUs"
            )
        pieces = split_batch(x, self.parts)
        if not torch.is_grad_enabled():
            return torch.cat(in_turns([lambda p=p: blocks(p) for p in pieces], fresh_streams=True))
        trained = tuple(p for p in parameters if p.requires_grad)
        graphs = _Graphs(blocks, self.parts)
        return _InTurns.apply(x, graphs, *trained)


class _Graphs:
    """The sub-batches' graphs of one micro-batch, from its forward to its backward."""

    def __init__(self, blocks: Callable[[Tensor], Tensor], parts: int) -> None:
        self.blocks, self.parts = blocks, parts
        self.inputs: list[Tensor] = []
        self.outputs: list[Tensor] = []
        self.parameters: tuple[Tensor, ...] = ()

    def forward(self, x: Tensor, parameters: tuple[Tensor, ...]) -> Tensor:
        self.parameters = parameters
        self.inputs = [
            p.detach().requires_grad_(x.requires_grad) for p in split_batch(x, self.parts)
        ]
        with torch.enable_grad():
            jobs = [lambda p=p: self.blocks(p) for p in self.inputs]
            self.outputs = in_turns(jobs, fresh_streams=True)
        return torch.cat([y.detach() for y in self.outputs])

    def backward(self, grad: Tensor) -> tuple[Tensor | None, ...]:
        if not self.outputs:
            raise RuntimeError(
                "the sub-batches' graphs were freed by an earlier backward: a micro-batch's "
                "backward runs once (use retain_graph=False)"
            )
        grads = grad.chunk(self.parts)
        track_input = self.inputs[0].requires_grad
        jobs = []
        for x, y, g in zip(self.inputs, self.outputs, grads, strict=True):
            wanted = ([x] if track_input else []) + list(self.parameters)
            jobs.append(lambda y=y, g=g, w=wanted: torch.autograd.grad(y, w, g, allow_unused=True))
        per_part = in_turns(jobs)
        self.inputs, self.outputs = [], []
        x_grad = torch.cat([g[0] for g in per_part]) if track_input else None
        offset = 1 if track_input else 0
        summed: list[Tensor | None] = []
        for k in range(len(self.parameters)):
            parts = [g[offset + k] for g in per_part if g[offset + k] is not None]
            summed.append(_sum(parts) if parts else None)
        return (x_grad, *summed)


def _sum(tensors: list[Tensor]) -> Tensor:
    total = tensors[0]
    for tensor in tensors[1:]:
        total = total + tensor
    return total


class _InTurns(torch.autograd.Function):
    """A stage's blocks run in sub-batches; its backward runs theirs in turns and returns
    the input's gradient and the parameters' summed."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, graphs: _Graphs, *parameters: Tensor) -> Tensor:  # type: ignore[override]
        ctx.graphs = graphs
        return graphs.forward(x, parameters)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x_grad, *parameter_grads = ctx.graphs.backward(grad)
        return (x_grad, None, *parameter_grads)
