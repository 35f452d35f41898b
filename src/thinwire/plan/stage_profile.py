"""What each pipeline stage of a plan computes and which tensor-parallel collectives it
issues, measured on one process: the virtual accelerators' script for ``--compute sleep``.

For every stage of the plan, a fresh process joins PyTorch's *fake* process group (no
traffic: a collective returns at once) as a rank of that stage, builds the stage's
tensor-parallel shard exactly as :func:`thinwire.parallelize` does, and runs a micro-batch
forward and backward through it while a dispatch mode notes each collective (its shape,
dtype and the time since the last one). The gaps between collectives are the shard's
compute on this machine's core; the collectives are the ones the real shard issues
(``ColwiseParallel``/``RowwiseParallel``'s all-reduces, the vocabulary-parallel embedding's).
:mod:`thinwire.bench.sleeping_stages` replays them on the real ranks: sleep a gap, run the
collective on the real ``"tp"`` group, and so on.

The loss is not timed: the sleeping ranks compute it for real (it is small, and its
all-reduces are part of the step). Each profile also keeps what the planner needs: the
activations one micro-batch saves for its backward pass, the data-parallel exchange's cost
and state, and the optimizer's step time and state. :func:`profile_blocks` profiles the
parts a stage is made of (the embedding, each kind of block, the head and loss) once, and
:func:`compose_stage` adds them up into any stage's cost: a stage of the whole model costs
what its parts cost (bytes exactly, as ``tests/test_hybrid_sleep.py`` checks).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from thinwire.plan.optimizer_profile import optimizer_step_s

#: the collectives a stage may issue (functional ones from DTensor, c10d's from plain calls)
ALL_REDUCES = ("_c10d_functional.all_reduce.default", "c10d.allreduce_.default")


@dataclass(frozen=True)
class Collective:
    """One all-reduce a stage issues on its ``"tp"`` group, ``gap_s`` after the last."""

    gap_s: float
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        return math.prod(self.shape) * self.torch_dtype.itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        """The tensor's dtype."""
        return getattr(torch, self.dtype.removeprefix("torch."))


@dataclass(frozen=True)
class Pass:
    """A forward or backward pass: its collectives in order, then ``tail_s`` of compute."""

    collectives: tuple[Collective, ...]
    tail_s: float

    @property
    def compute_s(self) -> float:
        """The pass's compute: every gap and the tail."""
        return self.tail_s + sum(c.gap_s for c in self.collectives)


@dataclass(frozen=True)
class StageProfile:
    """One stage (one model chunk) of a plan, on one micro-batch, as one of its ranks."""

    index: int
    forward: Pass
    backward: Pass
    output_shape: tuple[int, ...]
    output_dtype: str
    parameter_shapes: tuple[tuple[int, ...], ...]
    """The shards this stage's rank holds (what its data-parallel group exchanges)."""
    loss_collectives: tuple[Collective, ...] = ()
    """The all-reduces of the vocabulary-parallel loss (last stage, ``tp > 1``), per
    micro-batch: counted, not replayed (the sleeping ranks compute the loss for real)."""
    dp_sent_bytes: float = 0.0
    """What one rank of this stage sends per step in its data-parallel exchange, as the
    planner's cost model counts it (:func:`thinwire.plan.profile_method.measure_method`)."""
    dp_cost: Any = None
    """That exchange's :class:`thinwire.plan.cost.MethodCost` (``None`` under ``dp=1``)."""
    optimizer_s: float = 0.0
    """One optimizer step over this rank's shard (median), alone on a core."""
    saved_bytes: int = 0
    """What one micro-batch's forward saves for its backward (the loss's too, on the last
    stage), measured with ``saved_tensors_hooks``."""
    exchange_bytes: int = 0
    """The data-parallel exchange's state on this rank (residuals, warm starts)."""
    optimizer_state_bytes: int = 0
    """The optimizer's state over this rank's shard after a step."""
    recompute: Pass | None = None
    """The recomputation of one micro-batch (its checkpointed blocks' forward again),
    when the plan recomputes on this stage."""
    segment_passes: tuple[Pass, ...] = ()
    """If asked for: the forward of the stage's last ``k`` blocks at index ``k - 1``, what
    recomputing ``k`` blocks costs (so that plans differing only in recomputation share
    one profile)."""
    segment_saved: tuple[int, ...] = ()
    """What those ``k`` blocks save (their input included), at index ``k - 1``."""
    tail_saved_bytes: int = 0
    """What the parts after the blocks save (the head and loss, on the last stage)."""
    input_bytes: int = 0
    """A block's input per micro-batch (what a checkpointed segment keeps)."""
    recompute_saved: int = 0
    """What :attr:`recompute` saves again (its input included)."""
    subbatches: int = 1
    """Sub-batches per micro-batch (:mod:`thinwire.plan.turns`): :attr:`forward`,
    :attr:`backward` and :attr:`recompute` are one sub-batch's, run this many times in
    turns; everything else is per micro-batch."""

    @property
    def forward_s(self) -> float:
        """One micro-batch's forward compute (every sub-batch's)."""
        return self.subbatches * self.forward.compute_s

    @property
    def backward_s(self) -> float:
        """One micro-batch's backward compute (every sub-batch's)."""
        return self.subbatches * self.backward.compute_s

    @property
    def recompute_s(self) -> float:
        """One micro-batch's recomputation (every sub-batch's); 0 without one."""
        return self.subbatches * self.recompute.compute_s if self.recompute else 0.0

    def recomputing(self, blocks: int, ratio: float) -> StageProfile:
        """This profile for a stage of ``blocks`` blocks recomputing ``ratio`` of them
        (from :attr:`segment_passes`)."""
        from thinwire.parallel.recompute import checkpointed_blocks

        count = checkpointed_blocks(ratio, blocks)
        if count and len(self.segment_passes) < count:
            raise ValueError(f"stage {self.index} was profiled without its recomputation")
        if not count:
            return replace(self, recompute=None, recompute_saved=0)
        return replace(
            self,
            recompute=self.segment_passes[count - 1],
            recompute_saved=self.segment_saved[count - 1],
        )

    @property
    def tp_allreduce_bytes(self) -> list[int]:
        """The sizes of every tensor-parallel all-reduce per micro-batch."""
        passes = (*self.forward.collectives, *self.backward.collectives)
        return [c.nbytes for c in passes] * self.subbatches + [
            c.nbytes for c in self.loss_collectives
        ]

    @property
    def activation_bytes(self) -> int:
        """Bytes of the hidden states it hands the next stage per micro-batch (and of the
        gradient it gets back)."""
        return torch.Size(self.output_shape).numel() * 4


class _CollectiveLog(TorchDispatchMode):
    """Notes every all-reduce dispatched under it, with the time since the last."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []
        self.last = time.perf_counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(func) in ALL_REDUCES:
            now = time.perf_counter()
            tensors = [a for a in _flatten(args) if isinstance(a, torch.Tensor)]
            for tensor in tensors:
                self.collectives.append(
                    Collective(now - self.last, tuple(tensor.shape), str(tensor.dtype))
                )
                now = self.last = time.perf_counter()
            result = func(*args, **(kwargs or {}))
            self.last = time.perf_counter()
            return result
        return func(*args, **(kwargs or {}))

    def finish(self) -> Pass:
        """The pass so far, its tail up to now."""
        return Pass(tuple(self.collectives), time.perf_counter() - self.last)


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [leaf for item in value for leaf in _flatten(item)]
    return [value]


def _median_pass(passes: list[Pass]) -> Pass:
    """Per gap, the median over repeats (the collectives are the same in every repeat)."""
    first = passes[0]
    collectives = tuple(
        Collective(statistics.median(p.collectives[i].gap_s for p in passes), c.shape, c.dtype)
        for i, c in enumerate(first.collectives)
    )
    return Pass(collectives, statistics.median(p.tail_s for p in passes))


@dataclass
class _FakeWorld:
    """The task's model, its layout, the plan's mesh and loss, and one micro-batch, on
    PyTorch's fake process group (collectives return at once)."""

    model: Any
    layout: Any
    mesh: Any
    loss: Any
    batch: tuple[torch.Tensor, torch.Tensor]


@contextlib.contextmanager
def fake_world(source: Any, plan: Any, microbatch: int) -> Iterator[_FakeWorld]:
    """The model of ``source`` (a :class:`~thinwire.plan.model_source.ModelSource`) under
    ``plan``'s mesh on PyTorch's fake process group, with a micro-batch of ``microbatch``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from thinwire.parallel.layout import read_layout
    from thinwire.parallel.loss import sharded_loss
    from thinwire.parallel.mesh import make_mesh

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        model, (tokens, targets) = source.build()
        layout = read_layout(model)
        mesh = make_mesh(plan)
        loss = sharded_loss(None, mesh["tp"] if plan.tp > 1 else None, layout.vocab)
        yield _FakeWorld(model, layout, mesh, loss, (tokens[:microbatch], targets[:microbatch]))
    finally:
        dist.destroy_process_group()


def task_source(task_name: str, task_options: dict[str, Any]) -> Any:
    """The :class:`~thinwire.plan.model_source.ModelSource` of a task and its options."""
    from thinwire.plan.model_source import ModelSource

    return ModelSource(task_name, task_options)


def stage_of(world: _FakeWorld, plan: Any, blocks: range, first: bool, last: bool) -> Any:
    """A stage of ``blocks``, sharded over ``"tp"`` as :func:`thinwire.parallelize` does."""
    from thinwire.parallel.stages import StageModule
    from thinwire.parallel.tensor import apply_tensor_parallel

    stage = StageModule(world.model, world.layout, blocks, first=first, last=last)
    if plan.tp > 1:
        apply_tensor_parallel(stage, world.mesh["tp"])
    return stage


def in_fresh_process(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a fresh process (a core and a process group of its own), one such
    profile at a time on this machine (:mod:`thinwire.plan.profile_lock`)."""
    from thinwire.plan.fresh_process import run_fresh
    from thinwire.plan.profile_lock import profiling_alone

    with profiling_alone():
        return run_fresh(fn, *args)


def _profile_in_fake_world(
    task_name: str, task_options: dict[str, Any], plan: Any, microbatch: int, repeats: int,
    optimizer: str = "adamw", segments: bool = False,
) -> list[StageProfile]:  # fmt: skip
    """In a fresh process on the fake process group: every stage of ``plan``, one after
    another, each timed on one micro-batch."""
    from thinwire.parallel.layout import submodule
    from thinwire.parallel.stages import even_boundaries, stage_ranges

    with fake_world(task_source(task_name, task_options), plan, microbatch) as world:
        blocks = len(submodule(world.model, world.layout.blocks))
        ranges = stage_ranges(blocks, plan.stages or even_boundaries(blocks, plan.chunks))
        profiles = []
        for index, kept in enumerate(ranges):
            profile = profile_stage(
                index,
                stage_of(world, plan, kept, first=index == 0, last=index == plan.chunks - 1),
                world.loss,
                world.batch,
                plan,
                repeats,
                optimizer,
            )
            ratio = plan.recompute[index] if plan.recompute else 0.0
            if segments or ratio:
                profile = _with_segments(world, plan, profile, kept, repeats)
            profiles.append(profile.recomputing(len(kept), ratio))
        return profiles


def _with_segments(
    world: Any, plan: Any, profile: StageProfile, kept: range, repeats: int
) -> StageProfile:
    """``profile`` with what recomputing each number of its last blocks costs and saves."""
    tokens, targets = world.batch
    shape = (tokens.shape[0], tokens.shape[1], layout_dim(world.model))
    passes, saved = [], []
    for count in range(1, len(kept) + 1):
        segment = stage_of(world, plan, kept[len(kept) - count :], first=False, last=False)
        timed = []
        for _ in range(repeats + 1):
            log = _CollectiveLog()
            with log:
                segment(torch.randn(shape).requires_grad_())
            timed.append(log.finish())
        passes.append(_median_pass(timed[1:]))
        saved.append(_saved_bytes(segment, world.loss, torch.randn(shape), targets))
    tail = 0
    if profile.index == plan.chunks - 1:
        end = range(kept.stop, kept.stop)
        tail_stage = stage_of(world, plan, end, first=False, last=True)
        tail = _saved_bytes(tail_stage, world.loss, torch.randn(shape), targets)
    return replace(
        profile,
        segment_passes=tuple(passes),
        segment_saved=tuple(saved),
        tail_saved_bytes=tail,
        input_bytes=torch.Size(shape).numel() * 4,
    )


def profile_stage(
    index: int, stage: Any, loss: Any, batch: tuple[torch.Tensor, torch.Tensor], plan: Any,
    repeats: int, optimizer: str = "adamw",
) -> StageProfile:  # fmt: skip
    """``stage`` (``index``) timed on ``batch``, its memory and exchange measured."""
    tokens, targets = batch
    forwards, backwards, output, loss_log = [], [], None, _CollectiveLog()
    for _ in range(repeats + 1):
        if stage.first:
            x = tokens
        else:
            width = layout_dim(stage.model)
            x = torch.randn(tokens.shape[0], tokens.shape[1], width, requires_grad=True)
        log = _CollectiveLog()
        with log:
            output = stage(x)
        forwards.append(log.finish())
        if stage.last:
            loss_log = _CollectiveLog()
            with loss_log, torch.no_grad():
                loss(output.detach(), targets)
        grad = torch.randn_like(output)
        log = _CollectiveLog()
        with log:
            output.backward(grad)
        backwards.append(log.finish())
        stage.zero_grad(set_to_none=True)
    assert output is not None
    shapes = tuple(tuple(_local(p).shape) for p in stage.parameters())
    optimizer_s, optimizer_state = optimizer_step_s(optimizer, shapes, repeats)
    profile = StageProfile(
        index,
        _median_pass(forwards[1:]),
        _median_pass(backwards[1:]),
        tuple(output.shape),
        str(output.dtype),
        shapes,
        loss_collectives=loss_log.finish().collectives,
        optimizer_s=optimizer_s,
        optimizer_state_bytes=optimizer_state,
        saved_bytes=_saved_bytes(stage, loss, x, targets),
    )
    return for_method(profile, plan)


def _saved_bytes(stage: Any, loss: Any, x: torch.Tensor, targets: torch.Tensor) -> int:
    """What one micro-batch's forward (and the loss, on the last stage) saves for backward."""
    from thinwire.plan.activations import SavedActivations

    with SavedActivations(exclude=list(stage.parameters())) as saved:
        output = stage(x.detach().requires_grad_(x.is_floating_point()))
        if stage.last:
            output = loss(output, targets)
        peak = saved.peak_bytes
    del output
    return peak


def _exchange_bytes(plan: Any, shapes: tuple[tuple[int, ...], ...]) -> int:
    from thinwire.plan.memory import exchange_state_bytes

    if plan.dp == 1:
        return 0
    params = [(f"p{i}", torch.zeros(shape)) for i, shape in enumerate(shapes)]
    return exchange_state_bytes(plan.dp_method, params, world_size=plan.dp, options=plan.dp_options)


def _dp_cost(plan: Any, shapes: tuple[tuple[int, ...], ...]) -> Any:
    from thinwire.parallel.plan import engine_compressor
    from thinwire.plan.profile_method import measure_method

    if plan.dp == 1:
        return None
    params = [(f"p{i}", torch.randn(shape)) for i, shape in enumerate(shapes)]
    return measure_method(
        engine_compressor(plan.dp_method),
        params,
        world_size=plan.dp,
        options=plan.dp_options,
        repeats=1,
    )


def for_method(profile: StageProfile, plan: Any) -> StageProfile:
    """``profile`` (a stage of ``plan`` or of a plan of the same shape) with ``plan``'s
    data-parallel exchange: its cost, bytes and state measured on the stage's shards. The
    compute is the same whatever the method, so plans differing only in their method can
    sleep one profile's compute."""
    dp_cost = _dp_cost(plan, profile.parameter_shapes)
    return replace(
        profile,
        dp_cost=dp_cost,
        dp_sent_bytes=0.0 if dp_cost is None else dp_cost.sent_bytes(plan.dp),
        exchange_bytes=_exchange_bytes(plan, profile.parameter_shapes),
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def layout_dim(model: torch.nn.Module) -> int:
    """The model's hidden size (the width of what stages hand each other)."""
    for name in ("dim", "hidden_size", "n_embd"):
        value = getattr(getattr(model, "config", None), name, None)
        if isinstance(value, int):
            return value
    raise ValueError(
        f"cannot tell {type(model).__name__}'s hidden size (no config.dim, hidden_size or "
        "n_embd): --compute sleep with pipeline stages needs it"
    )


def profile_plan(
    task_name: str,
    task_options: dict[str, Any],
    plan: Any,
    microbatch: int,
    repeats: int = 3,
    optimizer: str = "adamw",
    segments: bool = False,
) -> list[StageProfile]:
    """Every stage of ``plan``, profiled one after another in a fresh process on the fake
    process group (so that each has this machine's core to itself); ``optimizer``
    (``"adamw"`` or ``"sgd"``) is timed over each stage's shard. ``segments``: time what
    recomputing each number of blocks costs (:attr:`StageProfile.segment_passes`). A plan
    with sub-batches is profiled on one sub-batch (:func:`thinwire.plan.turns.in_subbatches`)."""
    from thinwire.plan.turns import in_subbatches

    parts = plan.subbatches
    profiles = in_fresh_process(
        _profile_in_fake_world, task_name, task_options, plan, microbatch // parts, repeats,
        optimizer, segments,
    )  # fmt: skip
    return [in_subbatches(p, parts) for p in profiles]
