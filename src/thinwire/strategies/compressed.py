"""Any thinwire compressor under DDP: ``thinwire.register(ddp_model, name, **options)``.

Every registered compressor is a strategy of this kind under its own name; its options are
the compressor's, plus ``communicator`` (``auto``, ``allreduce``, ``allgather``,
``direct``). Some compressors get options of the benchmark's unless given, recorded with
each result (:data:`DEFAULT_OPTIONS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from thinwire.comm.collectives import COMMUNICATORS
from thinwire.compress.base import Aggregation, Compressor
from thinwire.compress.registry import compressor as build_compressor
from thinwire.compress.registry import compressors
from thinwire.data_parallel.ddp_hook import register
from thinwire.strategies.base import Strategy, Wrapped

#: options a thinwire compressor gets unless given, recorded with its results: PowerSGD and
#: its one-round form at rank 2, the rank ``ddp-powersgd`` defaults to, so that the
#: implementations compare; the compressors' own defaults where they depart from the
#: published method (1-bit's and TernGrad's ``per_row``, DGC's ``masking``), named so
#: that every record says which form ran
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "powersgd": {"rank": 2},
    "powersgd-oneround": {"rank": 2},
    "onebit": {"per_row": True},
    "terngrad": {"per_row": True},
    "dgc": {"masking": False},
}


def split_communicator(options: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """A compressor strategy's options without ``communicator``, and the communicator
    (``"auto"`` unless given): the one option that configures the exchange, not the
    compressor."""
    rest = dict(options)
    return rest, rest.pop("communicator", "auto")


class Compressed(Strategy):
    """DDP with a thinwire compressor registered through its communication hook."""

    costing = "thinwire"

    def __init__(self, name: str) -> None:
        self.name = name  # type: ignore[misc]
        self.summary = f"DDP + thinwire {name}: {compressors()[name]}"  # type: ignore[misc]

    def options(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The compressor's options (built once to check them) and ``communicator``."""
        merged = {**DEFAULT_OPTIONS.get(self.name, {}), **(given or {})}
        options_of_compressor, communicator = split_communicator(merged)
        built = build_compressor(self.name, **options_of_compressor)  # raises if invalid
        choices = ("auto", *COMMUNICATORS)
        if communicator not in choices:
            raise ValueError(
                f"{self.name}: communicator must be one of {', '.join(choices)}, got "
                f"{communicator!r}"
            )
        if communicator == "allreduce" and built.aggregation is Aggregation.GATHER:
            raise ValueError(
                f"{self.name}: its payloads must be gathered (they cannot be summed), so it "
                "cannot run on communicator 'allreduce'; use 'allgather', 'direct' or 'auto'"
            )
        return merged

    def compressor(self, options: Mapping[str, Any]) -> Compressor:
        """The compressor built with ``options``."""
        return build_compressor(self.name, **split_communicator(options)[0])

    def wrap(self, model, optimizer, options, setup):  # type: ignore[no-untyped-def]
        """``model`` under DDP, its buckets exchanged through the compressor."""
        ddp = setup.ddp(model)
        engine = register(
            ddp, self.name, optimizer=optimizer, fuse_rounds=setup.fuse_rounds, **options
        )
        return Wrapped(ddp, optimizer, engine)
