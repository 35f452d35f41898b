"""Sparse embedding tables with DDP for the rest of the model (EmbRace-style).

``emb-allgather``: the tables replicated, their gradients all-gathered as (row ids, rows);
``emb-sharded``: the tables' rows sharded over the ranks, looked up with all-to-all
(:mod:`thinwire.data_parallel.sparse`). Both need a task whose model has ``nn.Embedding``
layers (``packages``); its other parameters go through DDP, with ``compressor`` (default
``none``: DDP's own all-reduce) if given. ``emb-sharded`` also takes ``overlap`` (the
tables' own process groups) and ``prefetch`` (route the next batch's ids during this step;
needs ``overlap`` and a model that looks its input up in one table). The cost model models
them from the ids the task's batches look up (:mod:`thinwire.plan.embedding`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from torch import nn

from thinwire.compress.base import Compressor
from thinwire.data_parallel.ddp_hook import register
from thinwire.data_parallel.sparse import (
    ShardedEmbedding,
    allgather_embeddings,
    dense_embeddings,
    shard_embeddings,
)
from thinwire.strategies.base import Wrapped
from thinwire.strategies.carrying import CarriesCompressor
from thinwire.strategies.registry import register_strategy


class _Tables(CarriesCompressor):
    """Tables exchanged sparsely, the rest under DDP (with the compressor, if any)."""

    costing = "embedding"
    embedding = True

    def replace_tables(self, model: nn.Module, options: dict[str, Any]) -> list[str]:
        """Replace ``model``'s embeddings; the names of those replaced."""
        raise NotImplementedError

    def prepare(self, model, options):  # type: ignore[no-untyped-def]
        """``model`` with its ``nn.Embedding`` layers replaced (a collective)."""
        if not self.replace_tables(model, options):
            raise ValueError(
                f"method {self.name!r} needs a model with nn.Embedding layers, and this task's "
                "has none; choose a task with a large embedding (e.g. --task packages)"
            )
        return model

    def check_compressor(self, options: dict[str, Any], built: Compressor) -> None:
        """The tables' optimizer keeps its momentum: no compressor that applies its own."""
        if built.applies_momentum:
            raise ValueError(
                f"{self.name}: compressor {options['compressor']!r} applies momentum itself, "
                "which would take it from the tables' optimizer too; choose one that leaves "
                "momentum to the optimizer (e.g. powersgd, onebit, fp16)"
            )

    def wrap(self, model, optimizer, options, setup):  # type: ignore[no-untyped-def]
        """``model`` (from :meth:`prepare`) under DDP, which leaves the tables alone, with
        the dense part's compressor if one is named."""
        tables = [m for m in model.modules() if isinstance(m, ShardedEmbedding)]
        lookahead = None
        if options.get("prefetch"):
            if len(tables) != 1:
                raise ValueError(
                    f"{self.name}: prefetch hands the next input to the model's one sharded "
                    f"table, and this model has {len(tables)}; run it with prefetch false"
                )
            lookahead = tables[0].prefetch
        ddp = setup.ddp(model)
        engine = None
        if options["compressor"] != "none":
            engine = register(
                ddp,
                options["compressor"],
                optimizer=optimizer,
                fuse_rounds=setup.fuse_rounds,
                **options["compressor_options"],
            )
        return Wrapped(
            ddp, optimizer, engine, export=lambda: dense_embeddings(model), lookahead=lookahead
        )


@register_strategy
class AllGatherTables(_Tables):
    """Replicated tables whose gradients travel as (row ids, rows), all-gathered."""

    name = "emb-allgather"
    summary = "embedding gradients all-gathered as (row ids, rows); DDP for the rest"
    defaults: ClassVar[Mapping[str, Any]] = {"compressor": "none", "compressor_options": {}}

    def replace_tables(self, model: nn.Module, options: dict[str, Any]) -> list[str]:
        """Every ``nn.Embedding`` made a replicated, all-gathered table."""
        return allgather_embeddings(model)


@register_strategy
class ShardedTables(_Tables):
    """Tables whose rows are sharded over the ranks, looked up with all-to-all."""

    name = "emb-sharded"
    summary = "embedding rows sharded over the ranks, all-to-all lookups; DDP for the rest"
    defaults: ClassVar[Mapping[str, Any]] = {
        "overlap": True,
        "prefetch": True,
        "compressor": "none",
        "compressor_options": {},
    }

    def replace_tables(self, model: nn.Module, options: dict[str, Any]) -> list[str]:
        """Every ``nn.Embedding`` made a sharded table."""
        return shard_embeddings(model, overlap=options["overlap"])

    def check_own(self, options: dict[str, Any]) -> None:
        """``overlap`` and ``prefetch`` are booleans; prefetch and a compressor need the
        tables' own process groups."""
        for key in ("overlap", "prefetch"):
            if not isinstance(options[key], bool):
                raise ValueError(f"{self.name}: {key} must be true or false, got {options[key]!r}")
        if options["prefetch"] and not options["overlap"]:
            raise ValueError(
                f"{self.name}: prefetch needs overlap (the prefetch's own process group)"
            )
        if options["overlap"] is False and options["compressor"] != "none":
            raise ValueError(
                f"{self.name}: a thinwire compressor exchanges the dense gradients from its own "
                "thread on DDP's process group, so the table needs its own group: keep overlap "
                "true"
            )
