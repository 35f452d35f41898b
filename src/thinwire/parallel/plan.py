"""The plan of a hybrid-parallel run: how many ways data, pipeline and tensor parallel,
how many micro-batches, which pipeline schedule, where the stages are cut and how the
data-parallel dimension exchanges its gradients.

    plan = thinwire.ParallelPlan(dp=2, pp=2, tp=2, microbatches=4, schedule="1f1b",
                                 dp_method="powersgd", dp_options={"rank": 4})

A plan is pure data, checked when it is made (each number on its own) and again against the
world size (:meth:`ParallelPlan.check_world`) and the model (``thinwire.parallel.layout``)
before any training. Every error states the numbers and what to change.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from thinwire.compress.registry import compressor as build_compressor
from thinwire.data_parallel.local_methods import ROUND_METHODS, method_options
from thinwire.parallel.recompute import check_ratios

#: pipeline schedules, by the name a plan gives them (torch.distributed.pipelining's)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "shifted-1f1b")
#: the model chunks each pipeline rank holds under each schedule
CHUNKS_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "shifted-1f1b": 1}
#: the data-parallel method that sends gradients as they are
DENSE = "dense"


def engine_compressor(dp_method: str) -> str:
    """The thinwire compressor a ``dp`` group runs for ``dp_method`` (``"dense"``: the
    engine's ``"none"``, an all-reduce of each bucket; the planner profiles the same)."""
    return "none" if dp_method == DENSE else dp_method


def _check_degree(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class ParallelPlan:
    """Degrees of data (``dp``), pipeline (``pp``) and tensor (``tp``) parallelism and how
    to run them; ``dp * pp * tp`` must equal the number of ranks.

    The ranks form a mesh ``("pp", "dp", "tp")``: tensor parallelism innermost (ranks
    ``r`` and ``r + 1`` share a layer's shards, so under torchrun a tensor-parallel group
    sits on one host, where links are fast), pipeline stages outermost.
    """

    dp: int = 1
    """Data-parallel degree: copies of each stage and shard, each taking a slice of the batch."""
    pp: int = 1
    """Pipeline-parallel degree: ranks along the pipeline (stages cut at block boundaries)."""
    tp: int = 1
    """Tensor-parallel degree: ranks sharing each attention and MLP layer (and the
    vocabulary of the embedding, the head and the loss)."""
    microbatches: int = 1
    """Micro-batches each data-parallel slice of the batch is cut into for the pipeline."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` (two model
    chunks per pipeline rank) or ``"shifted-1f1b"`` (1F1B recomputing while the gradient
    travels: :mod:`thinwire.parallel.schedule_programs`)."""
    stages: tuple[int, ...] | None = None
    """Where stages start, as block indices after the first stage (``pp * chunks - 1``
    of them, increasing); ``None``: as even as the blocks allow."""
    recompute: tuple[float, ...] | float | None = None
    """Fraction of each stage's blocks (its last ones) whose activations are recomputed
    in the backward instead of kept: one number for every stage, a ratio per stage
    (``thinwire.parallel.recompute.stage_aware_ratios`` gives Merak's), or ``None``: none."""
    subbatches: int = 1
    """Sub-batches each micro-batch runs as inside a stage's blocks, taking turns so that
    one's tensor-parallel all-reduce overlaps the next's compute (Merak's sub-pipelined
    tensor parallelism, :mod:`thinwire.parallel.subpipeline`); ``1``: none. Needs
    ``tp > 1`` and micro-batches whose size it divides."""
    dp_method: str = DENSE
    """How the ``"dp"`` groups exchange gradients: ``"dense"`` (an all-reduce of every
    gradient), any thinwire compressor's name (``thinwire compressors``), or
    ``"diloco"`` / ``"local-sgd"``: each dp replica takes ``sync_every`` steps alone, then
    the replicas exchange pseudo-gradients (:class:`thinwire.DiLoCo`)."""
    dp_options: Mapping[str, Any] = field(default_factory=dict)
    """The compressor's options (``{"rank": 4}`` for PowerSGD, ...), or DiLoCo's
    (``{"sync_every": 50, "compressor": "fp16"}``)."""

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "microbatches", "subbatches"):
            _check_degree(name, getattr(self, name))
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        if self.stages is not None:
            stages = tuple(self.stages)
            object.__setattr__(self, "stages", stages)
            if len(stages) != self.chunks - 1:
                raise ValueError(
                    f"stages lists where each stage after the first starts: {self.chunks - 1} "
                    f"block indices for pp={self.pp} under {self.schedule!r} ({self.chunks} "
                    f"stages), got {len(stages)}: {list(stages)}"
                )
            if any(not isinstance(s, int) or isinstance(s, bool) for s in stages) or any(
                b <= a for a, b in zip((0, *stages), stages, strict=False)
            ):
                raise ValueError(f"stages must be increasing block indices > 0, got {list(stages)}")
        if self.recompute is not None:
            ratios = self.recompute
            if isinstance(ratios, int | float) and not isinstance(ratios, bool):
                ratios = (ratios,) * self.chunks
            elif not isinstance(ratios, list | tuple):
                raise TypeError(
                    f"recompute is a fraction of the blocks or one per stage, got {ratios!r}"
                )
            ratios = check_ratios(ratios, self.chunks)
            object.__setattr__(self, "recompute", None if not any(ratios) else ratios)
        if (
            self.schedule in ("1f1b", "shifted-1f1b")
            and self.pp > 1
            and self.microbatches < self.pp
        ):
            raise ValueError(
                f"schedule {self.schedule!r} needs at least as many micro-batches as pipeline "
                f"stages (microbatches={self.microbatches} < pp={self.pp}): use microbatches >= "
                f"{self.pp}, or schedule='gpipe' (what 1F1B becomes with fewer micro-batches)"
            )
        if self.schedule == "interleaved-1f1b":
            rounds = max(1, self.microbatches // self.pp)
            if self.microbatches % rounds:
                raise ValueError(
                    f"schedule 'interleaved-1f1b' runs micro-batches in rounds of pp={self.pp}: "
                    f"microbatches={self.microbatches} must be below pp or a multiple of it "
                    f"(e.g. {rounds * self.pp})"
                )
        if self.subbatches > 1 and self.tp == 1:
            raise ValueError(
                f"subbatches={self.subbatches} overlaps tensor-parallel all-reduces with "
                "compute, but tp=1 has none: use tp > 1, or subbatches=1"
            )
        if not isinstance(self.dp_method, str):
            raise TypeError(f"dp_method must be a name, got {type(self.dp_method).__name__}")
        object.__setattr__(self, "dp_options", dict(self.dp_options))
        if self.dp_method in ROUND_METHODS:
            method_options(self.dp_method, self.dp_options)  # names the bad option
        elif self.dp_method != DENSE:
            build_compressor(self.dp_method, **self.dp_options)  # names the bad option
        elif self.dp_options:
            raise ValueError(
                f"dp_options {sorted(self.dp_options)} were given with dp_method='dense', "
                "which has none; name a compressor as dp_method, or drop the options"
            )

    @property
    def world_size(self) -> int:
        """The number of ranks the plan needs: ``dp * pp * tp``."""
        return self.dp * self.pp * self.tp

    @property
    def chunks(self) -> int:
        """Pipeline stages in all (``pp`` times the chunks each rank holds)."""
        return self.pp * CHUNKS_PER_RANK[self.schedule]

    def check_world(self, world_size: int) -> None:
        """Refuse a plan whose degrees do not multiply to ``world_size``."""
        if self.world_size != world_size:
            raise ValueError(
                f"the plan needs dp * pp * tp = {self.dp} * {self.pp} * {self.tp} = "
                f"{self.world_size} ranks, but {world_size} are running: change the degrees "
                f"so that they multiply to {world_size}, or start {self.world_size} ranks"
            )
        if self.schedule == "interleaved-1f1b" and self.pp == 1:
            raise ValueError(
                "schedule 'interleaved-1f1b' needs pp >= 2 (it interleaves model chunks "
                "between pipeline ranks); use '1f1b' or 'gpipe' with pp=1"
            )

    def check_batch(self, batch: int) -> None:
        """Refuse a global batch that does not split into ``dp`` slices of
        ``microbatches`` equal micro-batches (unequal ones would weight samples unevenly),
        each of ``subbatches`` equal sub-batches."""
        parts = self.dp * self.microbatches
        if batch % parts:
            raise ValueError(
                f"a global batch of {batch} samples does not split evenly into dp * "
                f"microbatches = {self.dp} * {self.microbatches} = {parts} micro-batches; "
                f"use a batch that is a multiple of {parts}"
            )
        if (batch // parts) % self.subbatches:
            raise ValueError(
                f"micro-batches of {batch // parts} samples (a batch of {batch} over dp * "
                f"microbatches = {parts}) do not split into subbatches={self.subbatches}: use a "
                f"batch that is a multiple of {parts * self.subbatches}, or fewer sub-batches"
            )

    def spec(self) -> str:
        """The plan as one line that ``thinwire.parallelize(model, spec)``, ``thinwire bench
        --plans`` and ``thinwire plan`` read and write: ``4x2x1/mb8/1f1b/stages4``."""
        from thinwire.parallel.plan_spec import plan_label

        return plan_label(self)

    def describe(self) -> str:
        """The plan as one canonical line (ranks compare it to agree on the plan)."""
        return json.dumps(asdict(self), sort_keys=True, default=str)

    def __str__(self) -> str:
        method = self.dp_method + (
            "(" + ", ".join(f"{k}={v}" for k, v in sorted(self.dp_options.items())) + ")"
            if self.dp_options
            else ""
        )
        return (
            f"dp={self.dp} pp={self.pp} tp={self.tp} microbatches={self.microbatches} "
            f"schedule={self.schedule} dp_method={method}"
            + (f" recompute={list(self.recompute)}" if self.recompute else "")
            + (f" subbatches={self.subbatches}" if self.subbatches > 1 else "")
        )
