"""What a training strategy is: a name, validated options, a way to wrap a model and its
optimizer to train over several ranks, and how the planner costs it.

A strategy is one module of :mod:`thinwire.strategies` defining one or more
:class:`Strategy` subclasses decorated with :func:`~thinwire.strategies.registry.register_strategy`.
``thinwire bench`` wraps models with :meth:`Strategy.wrap`, ``thinwire plan`` validates
options with :meth:`Strategy.options` and measures traffic the way :attr:`Strategy.costing`
names (a measurement :mod:`thinwire.plan` knows), then times the step under
:attr:`Strategy.schedule`.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire.comm.engine import GradientExchange
from thinwire.comm.replicas import copy_module_states
from thinwire.compress.base import Compressor
from thinwire.data_parallel.buckets import BucketSpec, ddp_bucket_options

#: the measurements :mod:`thinwire.plan` knows (:attr:`Strategy.costing`)
COSTINGS = (
    "none",  # no exchange
    "dense",  # DDP's fp32 all-reduce of every bucket
    "torch-fp16",  # PyTorch's fp16_compress_hook, called on each bucket
    "torch-powersgd",  # PyTorch's powerSGD_hook, one bucket (as the bench runs it on gloo)
    "thinwire",  # a thinwire compressor through the engine, in DDP's buckets
    "wrapper",  # a thinwire compressor in the optimizer wrapper's 25 MB buckets
    "embedding",  # the tables' lookups and rows, the rest as the inner strategy
)
#: how the step-time model schedules a strategy's exchange (:attr:`Strategy.schedule`)
SCHEDULES = ("ddp", "dga", "ps-sync", "ps-async", "local")


@dataclass
class Wrapped:
    """A model made data parallel: the ``model`` to call, the ``optimizer`` front end to
    step (the plain optimizer under DDP), the thinwire ``engine`` if any, and ``finish``,
    which leaves every rank with the agreed weights (DGA's flush, the server's close: part
    of training, its traffic counted), ``export``, which makes the model evaluable on one
    rank after the measurements (sharded tables made whole), and ``lookahead``, if set,
    which takes the next step's input as soon as it is known (the sharded table's
    prefetch)."""

    model: nn.Module
    optimizer: Any
    engine: GradientExchange | None = None
    finish: Callable[[], None] = lambda: None
    export: Callable[[], None] = lambda: None
    lookahead: Callable[[torch.Tensor], None] | None = None


@dataclass(frozen=True)
class WrapSetup:
    """How a run wants its models wrapped, whatever the strategy.

    ``bucket_cap_mb``: DDP's bucket size (``None``: DDP's default, a 1 MB first bucket and
    25 MB after it; ``"tapered"`` or ``"tapered:TAIL:FACTOR"``:
    :func:`thinwire.tapered_buckets`; a size is also the bucket size of ``dga``).
    ``fuse_rounds``: the option of that name of :func:`thinwire.register` and of ``dga``.
    ``broadcast_buffers``: DDP's option (rank 0's buffers, e.g. batch-norm statistics,
    sent to all at every forward).
    """

    bucket_cap_mb: BucketSpec = None
    fuse_rounds: bool = True
    broadcast_buffers: bool = True

    def ddp(self, model: nn.Module, **extra: Any) -> DistributedDataParallel:
        """``model`` under DDP with this setup's buckets and buffer option (``extra``
        overrides them). Rank 0's parameters and buffers are copied to the other ranks only
        where they differ (:func:`~thinwire.comm.replicas.copy_module_states`), not whole
        as DDP's own start would."""
        options = {**buffer_sync_options(self.broadcast_buffers)}
        if "bucket_cap_mb" not in extra:
            options.update(ddp_bucket_options(self.bucket_cap_mb, model))
        if not extra.get("init_sync", False):  # unless DDP's own whole-model copy is asked for
            copy_module_states(model, extra.get("process_group"))  # only what differs
        options["init_sync"] = False  # so DDP does not send the whole model again
        return DistributedDataParallel(model, **{**options, **extra})


class Strategy(ABC):
    """One way to train a model over several ranks.

    Subclasses set the class attributes and implement :meth:`wrap`; those with options
    override :attr:`defaults` and :meth:`check`.
    """

    #: the name ``thinwire bench --methods`` and ``thinwire plan`` use
    name: ClassVar[str]
    #: one line for listings
    summary: ClassVar[str]
    #: which of :data:`COSTINGS` measures its traffic
    costing: ClassVar[str] = "dense"
    #: which of :data:`SCHEDULES` times its step
    schedule: ClassVar[str] = "ddp"
    #: whether its ranks wait for each other every step (else its throughput is wall-clock)
    synchronised: ClassVar[bool] = True
    #: whether it moves embedding tables sparsely (needs a task with nn.Embedding layers)
    embedding: ClassVar[bool] = False
    #: its options and their defaults (validated by :meth:`options`)
    defaults: ClassVar[Mapping[str, Any]] = {}

    def options(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The defaults updated with ``given``, validated; unknown options raise a
        ``ValueError`` that lists the known ones."""
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"method {self.name!r} has no option(s) {', '.join(unknown)}; its options "
                f"are: {', '.join(sorted(self.defaults)) or 'none'}"
            )
        merged = {**self.defaults, **given}
        self.check(merged, given)
        return merged

    def check(self, options: dict[str, Any], given: Mapping[str, Any]) -> None:
        """Refuse invalid ``options`` (``given``: those the user set) with what to do."""

    def compressor(self, options: Mapping[str, Any]) -> Compressor | None:
        """The thinwire compressor it sends through, if any."""
        return None

    def prepare(self, model: nn.Module, options: Mapping[str, Any]) -> nn.Module:
        """``model`` as this strategy trains it, before its optimizer is built."""
        return model

    @abstractmethod
    def wrap(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        options: Mapping[str, Any],
        setup: WrapSetup,
    ) -> Wrapped:
        """``model`` (from :meth:`prepare`) and ``optimizer`` made to train over every
        rank. Called on every rank once ``torch.distributed`` is initialised."""


def buffer_sync_options(broadcast_buffers: bool) -> dict[str, Any]:
    """DDP's keyword arguments for (not) broadcasting the buffers before every forward pass:
    none for DDP's default (broadcasting); else ``forward_sync_buffers=False`` where DDP
    has it (torch 2.13 renamed the option and warns about the old name) and
    ``broadcast_buffers=False`` before that."""
    if broadcast_buffers:
        return {}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def check_count(name: str, key: str, value: Any, least: int) -> None:
    """Refuse an option that is not an integer >= ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}: {key} must be an integer >= {least}, got {value!r}")
