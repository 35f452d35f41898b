"""The compressor interface: pure tensor math that asks for collectives, never calls them.

A compressor turns one gradient tensor into payload tensors that travel, and turns what
the other ranks sent back into an averaged gradient. Some compressors need one exchange
(top-k: gather (values, indices) from every rank), some need several with math between
them (PowerSGD: sum P, orthogonalise, sum Q). thinwire expresses every compressor as an
*exchange protocol*: a generator that yields :class:`Request` objects (``Sum``, ``Max`` or
``Gather`` of some payload tensors) and receives the collective's answer. A communicator
drives the generators of all tensors in a bucket in lock-step and fuses each round's
requests into one collective, so the compressor itself contains no ``torch.distributed``.

Single-round compressors only implement :meth:`Compressor.compress` and
:meth:`Compressor.decompress`; the default :meth:`Compressor.exchange` does the rest.

Every exchange returns an :class:`Exchanged`: ``mean`` is the averaged gradient every
rank agrees on; ``local`` is what this rank's own contribution decodes to, which error
feedback subtracts from what it meant to send (``residual = corrected - local``).
"""

from __future__ import annotations

import enum
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor


class Op(enum.Enum):
    """What a communicator does with the payload tensors of one request."""

    SUM = "sum"  #: element-wise sum over ranks; the answer is a list of summed tensors
    MAX = "max"  #: element-wise maximum over ranks; the answer is a list of tensors
    GATHER = "gather"  #: every rank's tensors; the answer is a list (one per rank) of lists
    #: rows ``counts[j]`` of each tensor go to rank j (uneven all-to-all); the answer is a
    #: list (one per source rank) of lists: the rows each rank sent this one
    SCATTER = "scatter"


class Aggregation(enum.Enum):
    """How a compressor's payloads combine across ranks, as declared by the compressor."""

    SUM = "sum"  #: payloads can be summed in a ring all-reduce (fp16, PowerSGD, random-k)
    GATHER = "gather"  #: payloads must be gathered and decoded one by one (top-k, signs)


@dataclass(frozen=True)
class Request:
    """One collective that an exchange protocol asks for: ``op`` over ``tensors``."""

    op: Op
    tensors: tuple[Tensor, ...]
    #: the tensors are the protocol's own scratch, read no more after the request: a
    #: communicator may compute the answer in them (no copy)
    scratch: bool = False
    #: for a scatter: how many leading rows of the tensors go to each rank, in order
    counts: tuple[int, ...] | None = None

    @staticmethod
    def sum(*tensors: Tensor, scratch: bool = False) -> Request:
        """Ask for the element-wise sum of ``tensors`` over all ranks (``scratch``: see
        the field)."""
        return Request(Op.SUM, tensors, scratch)

    @staticmethod
    def max(*tensors: Tensor) -> Request:
        """Ask for the element-wise maximum of ``tensors`` over all ranks."""
        return Request(Op.MAX, tensors)

    @staticmethod
    def gather(*tensors: Tensor) -> Request:
        """Ask for every rank's ``tensors`` (same shapes and dtypes on every rank)."""
        return Request(Op.GATHER, tensors)

    @staticmethod
    def scatter(counts: Sequence[int], *tensors: Tensor) -> Request:
        """Send rank j the next ``counts[j]`` rows of every one of ``tensors`` (rows in
        rank order; any number per rank); the answer holds, for each of ``tensors``, the
        rows every rank sent this one, one after another in source rank order. Shapes
        past the first dimension and dtypes match on every rank."""
        rows = {t.shape[0] for t in tensors}
        if len(rows) != 1 or sum(counts) != rows.pop():
            raise ValueError(
                f"a scatter's counts {list(counts)} must add up to the rows of every tensor "
                f"({[t.shape[0] for t in tensors]})"
            )
        return Request(Op.SCATTER, tensors, counts=tuple(int(c) for c in counts))


@dataclass(frozen=True)
class Exchanged:
    """The outcome of one tensor's exchange.

    ``mean``: the gradient averaged over ranks, identical on every rank.
    ``local``: this rank's own contribution as the receivers decode it, in the units of the
    tensor that was compressed (error feedback keeps ``corrected - local``).
    ``sent_indices``: for sparsifiers, the flat indices this rank sent *exactly*; memories
    then zero those entries (O(k)) instead of subtracting a dense ``local``, which may be
    ``None`` in that case. ``sent_counts``: see the field.
    """

    mean: Tensor
    local: Tensor | None
    sent_indices: Tensor | None = None
    #: for tensors exchanged side by side (:meth:`Compressor.exchange_segmented`): how
    #: many of ``sent_indices`` (flat indices into them all, grouped by tensor in order)
    #: are each tensor's
    sent_counts: list[int] | None = None


class Slot(NamedTuple):
    """Where a tensor sits: its stable ``key`` (a parameter name), the optimizer ``step``,
    the ``world_size`` it is averaged over and this process's ``rank``. Compressors key
    their state by ``key``; stochastic ones seed per-rank randomness from ``rank``. (A
    named tuple: the engine makes one per tensor per step, a frozen dataclass costs 3x.)"""

    key: str
    step: int
    world_size: int
    rank: int = 0


#: An exchange protocol: yields requests, receives their answers, returns the outcome.
Exchange = Generator[Request, Any, Exchanged]


class Compressor(ABC):
    """Base class of all gradient compressors.

    Subclasses set ``name``, ``summary`` (one line, shown by ``thinwire.compressors()``) and
    ``aggregation``, and implement either ``compress``/``decompress`` (one round) or
    ``exchange`` (several rounds). State that must survive a checkpoint (warm-start
    matrices, random generators) goes through ``state_dict``/``load_state_dict``.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    aggregation: ClassVar[Aggregation]
    #: whether the compressor is meant to be used with residual error feedback by default
    wants_error_feedback: ClassVar[bool] = False
    #: rounds of the exchange protocol; later rounds depend on earlier answers (PowerSGD: 2)
    rounds: ClassVar[int] = 1
    #: whether one step's exchange uses no state left by earlier steps (so exchanges of
    #: different steps may run concurrently); error-feedback memories are state too
    stateless: ClassVar[bool] = False
    #: whether each value's payload depends on that value alone and the compressor keeps
    #: no state by tensor key (none, fp16, bf16): the engine then exchanges a bucket's
    #: tensors side by side as one flat tensor
    elementwise: ClassVar[bool] = False
    #: whether the compressor exchanges same-shaped tensors stacked
    #: (:meth:`exchange_stacked`), for fewer, larger kernels (PowerSGD)
    batches: ClassVar[bool] = False
    #: whether the compressor exchanges small tensors side by side as segments of one
    #: flat tensor (:meth:`exchange_segmented`): 1-bit SGD, signSGD
    segmented: ClassVar[bool] = False
    #: whether the exchange scatters (``Request.scatter``: an uneven all-to-all), which
    #: only some communicators carry (top-k and DGC with ``partitioned``)
    scatters: ClassVar[bool] = False
    #: whether a NaN or an infinity in a tensor always reaches the sum its exchange asks
    #: for (one summed round of an element-wise image that keeps them: none, fp16, bf16):
    #: a communicator that checks its sums then catches every rank's non-finite values
    #: without a check of its own (on a GPU, kernels saved per step)
    transparent: ClassVar[bool] = False

    #: whether a segmented compressor takes large tensors as segments too off the CPU
    #: (where each one's own chunked path is not faster: a GPU launches per kernel),
    #: unless deterministic algorithms are asked for: a deterministic ``index_add_``
    #: sums a long segment slowly (6-8x a ResNet-18's step with a sum per tensor, H100)
    large_segments_off_cpu: ClassVar[bool] = False

    def bucket_as_segments(self, device: torch.device) -> bool:
        """Whether the compressor takes all of a bucket's compressed tensors on
        ``device`` (of one dtype) as one run of segments (:meth:`exchange_segmented`),
        whatever their sizes and shapes (PowerSGD on a GPU)."""
        return False

    def segments_large(self, device: torch.device) -> bool:
        """Whether a segmented compressor takes a bucket's large tensors (on ``device``)
        side by side too, as one more run of segments, rather than one at a time."""
        if not self.large_segments_off_cpu or device.type == "cpu":
            return False
        return not torch.are_deterministic_algorithms_enabled()

    # -- which tensors it handles ---------------------------------------------------------

    def compresses(self, tensor: Tensor) -> bool:
        """Whether this compressor should handle ``tensor``; others are sent dense."""
        return True

    # -- single-round compressors ---------------------------------------------------------

    def compress(self, tensor: Tensor, slot: Slot) -> tuple[list[Tensor], Any]:
        """Encode ``tensor`` into payload tensors and a local context that does not travel."""
        raise TypeError(f"compressor {self.name!r} implements exchange(), not compress()")

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """Decode one payload (this rank's or another's, or a sum of them) into a tensor."""
        raise TypeError(f"compressor {self.name!r} implements exchange(), not decompress()")

    # -- the protocol ---------------------------------------------------------------------

    def exchange(self, tensor: Tensor, slot: Slot) -> Exchange:
        """Average ``tensor`` over ranks: the default one-round protocol.

        Summable payloads are summed, decoded once and divided by the world size; gathered
        payloads are decoded one by one and averaged. A compressor that must divide before
        summing (half precision, for range) overrides this method.
        """
        payload, ctx = self.compress(tensor, slot)
        local = self.decompress(payload, ctx)
        if self.aggregation is Aggregation.SUM:
            summed = yield Request.sum(*payload)
            mean = self.decompress(summed, ctx).div_(slot.world_size)
        else:
            gathered = yield Request.gather(*payload)
            mean = torch.zeros_like(tensor)
            for rank_payload in gathered:
                mean.add_(self.decompress(rank_payload, ctx))
            mean.div_(slot.world_size)
        return Exchanged(mean=mean, local=local)

    def exchange_stacked(self, stacked: Tensor, slots: Sequence[Slot]) -> Exchange:
        """Average ``stacked[i]`` (the tensor of ``slots[i]``) over ranks for every ``i``
        at once; the outcome's ``mean`` and ``local`` are stacked the same way. Only for
        compressors that set ``batches``."""
        raise TypeError(f"compressor {self.name!r} does not exchange stacked tensors")

    def exchange_segmented(
        self, flat: Tensor, shapes: Sequence[torch.Size], slots: Sequence[Slot]
    ) -> Exchange:
        """Average the tensors of ``shapes`` (of ``slots``), lying side by side in ``flat``,
        over ranks at once; the outcome's ``mean`` and ``local`` are flat the same way.
        Only for compressors that set ``segmented``."""
        raise TypeError(f"compressor {self.name!r} does not exchange segments")

    # -- error feedback -------------------------------------------------------------------

    def make_memory(self) -> Memory:
        """The error-feedback memory this compressor is used with by default."""
        from thinwire.compress.feedback import NoMemory, ResidualMemory

        return ResidualMemory() if self.wants_error_feedback else NoMemory()

    @property
    def applies_momentum(self) -> bool:
        """Whether the compressor applies momentum itself (its optimizer must not)."""
        return False

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise if ``optimizer`` conflicts with this compressor (DGC's own momentum)."""

    # -- checkpointing --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """State that a resumed run needs to continue exactly; empty for stateless ones."""
        return {}

    def snapshot(self) -> dict[str, Any]:
        """What :meth:`load_state_dict` puts back should the step under way be refused:
        :meth:`state_dict`; a compressor that never writes its state tensors in place
        may hand references, not copies (fewer operators a step)."""
        return self.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ValueError(f"compressor {self.name!r} is stateless but got state {list(state)}")

    @property
    def undoes_on_device(self) -> bool:
        """Whether :meth:`undo_where` puts back everything a refused step changed that the
        next steps' payloads depend on (stateless compressors have nothing to put back;
        one with state says so itself)."""
        return type(self).state_dict is Compressor.state_dict

    def undo_where(self, before: dict[str, Any], refused: Tensor) -> None:
        """Put this step's state back to ``before`` (:meth:`snapshot`) wherever the bool
        device flag ``refused`` is true, reading nothing back; nothing to do by default."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass(frozen=True)
class RunUpdate:
    """What one run of a bucket leaves its memory: what its tensors compensated to (the
    memory's own buffers), the run's outcome (over them all, side by side or stacked),
    that outcome split per tensor (made on demand), their slots, and whether the
    compressor handled them (else they went dense)."""

    correcteds: Sequence[Tensor]
    outcome: Exchanged
    results: Callable[[], Sequence[Exchanged]]
    slots: Sequence[Slot]
    compressed: bool


class Memory(ABC):
    """Error feedback: compensate a gradient before compression, remember what was not sent.

    ``compensate`` returns the tensor to compress (it may be a buffer the memory owns);
    ``update`` is told what was sent and keeps the rest for the next step. Memories hold
    fp32 state whatever the gradient's dtype.
    """

    @abstractmethod
    def compensate(self, grad: Tensor, slot: Slot, param: Tensor | None = None) -> Tensor:
        """The tensor to compress for ``grad`` (fp32), e.g. ``grad + residual``."""

    @abstractmethod
    def update(self, corrected: Tensor, sent: Exchanged, slot: Slot, compressed: bool) -> None:
        """Keep what ``corrected`` held and ``sent`` did not carry.

        ``compressed`` is False for tensors that went dense (the compressor declined them).
        """

    def compensate_many(
        self,
        grads: Sequence[Tensor],
        slots: Sequence[Slot],
        params: Sequence[Tensor | None],
        groups: Sequence[Sequence[int]] = (),
    ) -> list[Tensor]:
        """:meth:`compensate` for each of a bucket's gradients (memories may batch it;
        ``groups``: the positions of each group of gradients whose state :meth:`arrange`
        laid out side by side)."""
        return [self.compensate(g, s, p) for g, s, p in zip(grads, slots, params, strict=True)]

    def update_many(
        self,
        correcteds: Sequence[Tensor],
        sents: Sequence[Exchanged],
        slots: Sequence[Slot],
        compressed: bool,
    ) -> None:
        """:meth:`update` for each tensor of a run (memories may batch it)."""
        for corrected, sent, slot in zip(correcteds, sents, slots, strict=True):
            self.update(corrected, sent, slot, compressed)

    def update_runs(self, runs: Sequence[RunUpdate]) -> None:
        """:meth:`update_many` for each of a bucket's runs; a memory may take a run's
        outcome whole (where its buffers lie side by side) and batch across runs."""
        for run in runs:
            self.update_many(run.correcteds, run.results(), run.slots, run.compressed)

    def arrange(self, keys: Sequence[str], likes: Sequence[Tensor]) -> None:
        """Hold the state of ``keys`` (shaped as ``likes``), which exchange as one run,
        side by side in this order, where the memory can (a run of them is then one flat
        tensor without a copy, updated in one operation); nothing to do by default."""

    def commit(self) -> None:
        """The step is taken: what it left in the memory becomes the state the next step
        compensates with."""

    def rollback(self) -> None:
        """The step is refused (a non-finite gradient on some rank, a failed collective):
        put the memory back as it was before the step, as if it had never run."""

    @property
    def undoes_on_device(self) -> bool:
        """Whether :meth:`commit_unless` can put a step back without reading its verdict
        (a memory without state can; one with state must implement it)."""
        return type(self).state_dict is Memory.state_dict

    def commit_unless(self, refused: Tensor) -> None:
        """:meth:`commit` where the bool device flag ``refused`` is false, :meth:`rollback`
        where it is true, decided on the device (nothing read back)."""
        if not self.undoes_on_device:
            raise NotImplementedError(
                f"{type(self).__name__} cannot undo a step on the device; register with "
                "refusal='host'"
            )
        self.commit()

    def state_dict(self) -> dict[str, Any]:
        """Buffers to checkpoint, keyed by tensor key."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


def run_locally(exchange: Exchange, wire_bytes: list[int] | None = None) -> Exchanged:
    """Drive an exchange protocol for a world of one process (tests, single-process use).

    If ``wire_bytes`` is given, the payload size in bytes of every request is appended to
    it: what this rank would put on the wire.
    """
    answer: Any = None
    try:
        while True:
            request = exchange.send(answer)
            if wire_bytes is not None:
                wire_bytes.append(sum(t.numel() * t.element_size() for t in request.tensors))
            whole = request.op is Op.GATHER  # one rank: its own tensors (a scatter: its rows)
            answer = [list(request.tensors)] if whole else list(request.tensors)
    except StopIteration as stop:
        return stop.value


def is_real(value: object) -> bool:
    """Whether ``value`` is a finite real number, Python's or numpy's (not a bool, a
    string or NaN/Inf)."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def check_fraction(name: str, value: float) -> float:
    """Validate an option that must lie in (0, 1], with a message that names it."""
    if not is_real(value) or not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


def check_flag(name: str, value: object) -> None:
    """Refuse a switch that is not ``True`` or ``False`` (``"no"`` would read as true)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def is_integer(value: object) -> bool:
    """Whether ``value`` is an integer, Python's or numpy's (not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive_int(name: str, value: int) -> int:
    """Validate an option that must be an integer >= 1, with a message that names it."""
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


#: quantizers that scale per row (``per_row``) give their own scales only to rows of at
#: least this many values: below it a row's scales cost more than the codes they scale
MIN_ROW = 64


def scaled_rows(shape: torch.Size) -> int | None:
    """How many rows a per-row quantizer scales one by one in a tensor of ``shape``: the
    first dimension (an output channel or unit) of a tensor of two or more dimensions
    whose rows hold at least :data:`MIN_ROW` values; ``None`` (one scale for the whole
    tensor) otherwise."""
    if len(shape) < 2 or shape[0] == 0:
        return None
    return shape[0] if math.prod(shape) >= MIN_ROW * shape[0] else None


def check_floating(tensor: Tensor, what: str = "gradient") -> None:
    """Refuse non-floating tensors with a message that says what to do."""
    if not tensor.is_floating_point():
        raise TypeError(
            f"{what} has dtype {tensor.dtype}; thinwire compresses floating-point gradients "
            "only (float32, float16, bfloat16, float64)"
        )


def num_selected(numel: int, density: float) -> int:
    """How many of ``numel`` entries a sparsifier keeps at ``density`` (at least one)."""
    return max(1, min(numel, round(numel * density)))
