"""The sharded parameter server: ``thinwire.ParameterServer``, synchronous (``ps-sync``) or
asynchronous with a staleness bound (``ps-async``).

Options: ``servers`` (shards, run inside worker ranks 0 .. servers-1), ``compressor`` and
``compressor_options``; ``ps-async`` also ``staleness`` and ``momentum``: the servers'
momentum in place of the run's (``None``: the run's). Stale gradients act as momentum of
their own (Mitliagkas et al. 2016, "Asynchrony begets momentum"), so asynchronous training
usually wants less explicit momentum.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from thinwire.data_parallel.parameter_server import ParameterServer
from thinwire.strategies.base import Wrapped
from thinwire.strategies.carrying import CarriesCompressor
from thinwire.strategies.registry import register_strategy


def check_servers(name: str, options: Mapping[str, Any], workers: int) -> None:
    """Refuse more parameter-server shards than workers: ``thinwire bench`` and ``thinwire
    plan`` run the servers inside worker ranks (colocated), at most one per rank."""
    servers = options.get("servers", 0)
    if servers > workers:
        raise ValueError(
            f"{name}: {servers} server(s) for {workers} worker(s); the servers run inside "
            "worker ranks, so use at most one per worker"
        )


class _Served(CarriesCompressor):
    """Workers push (compressed) gradients to the shards and pull the new weights."""

    costing = "wrapper"
    mode = "sync"

    def wrap(self, model, optimizer, options, setup):  # type: ignore[no-untyped-def]
        """``optimizer`` behind colocated server shards (every rank is a worker)."""
        ps = ParameterServer(
            optimizer,
            model,
            options["compressor"],
            mode=self.mode,
            servers=options["servers"],
            staleness=options.get("staleness", 0),
            **options["compressor_options"],
        )
        return Wrapped(model, ps, None, ps.close)


@register_strategy
class SyncServer(_Served):
    """One push from every worker averaged per step: the same weights as all-reduce SGD."""

    name = "ps-sync"
    summary = "synchronous parameter server (push gradients, pull parameters)"
    schedule = "ps-sync"
    defaults: ClassVar[Mapping[str, Any]] = {
        "servers": 1,
        "compressor": "none",
        "compressor_options": {},
    }


@register_strategy
class AsyncServer(_Served):
    """Each push applied on its own; a worker waits while it would run more than
    ``staleness`` steps ahead of the slowest."""

    name = "ps-async"
    summary = "asynchronous parameter server with a staleness bound"
    schedule = "ps-async"
    synchronised = False
    mode = "async"
    defaults: ClassVar[Mapping[str, Any]] = {
        "servers": 1,
        "staleness": 2,
        "momentum": None,
        "compressor": "none",
        "compressor_options": {},
    }

    def check_own(self, options: dict[str, Any]) -> None:
        """The servers' momentum: in [0, 1), or ``None`` for the run's."""
        momentum = options.get("momentum")
        if momentum is not None and not (
            isinstance(momentum, (int, float))
            and not isinstance(momentum, bool)
            and 0 <= momentum < 1
        ):
            raise ValueError(f"{self.name}: momentum must be in [0, 1) or null, got {momentum!r}")
