"""Synchronise every H steps: ``local-sgd`` (average the weights) and ``diloco`` (an outer
Nesterov step on the averaged pseudo-gradient), :class:`thinwire.DiLoCo` under the bench.

Options (checked by :mod:`thinwire.data_parallel.local_methods`, as a hybrid plan's
``dp_method`` of the same name is): ``sync_every`` (H, inner steps per round),
``fragments`` (parts of the model exchanged at spread steps of a round), ``overlap``
(inner steps each exchange runs in the background), ``compressor`` and
``compressor_options`` (the pseudo-gradient's, with error feedback); ``diloco`` adds
``outer_lr``, ``outer_momentum`` and ``nesterov``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from thinwire.compress.base import is_real
from thinwire.data_parallel.local_methods import build_rounds, defaults, method_options
from thinwire.strategies.base import Wrapped
from thinwire.strategies.carrying import CarriesCompressor
from thinwire.strategies.registry import register_strategy


class Rounds(CarriesCompressor):
    """What local SGD and DiLoCo share: rounds of ``sync_every`` local steps."""

    costing = "wrapper"
    schedule = "local"
    synchronised = False  # ranks wait for each other once per round: wall-clock throughput

    def check_own(self, options: dict[str, Any]) -> None:
        """H, F, T, the outer settings and the compressor, as DiLoCo's methods check them."""
        method_options(self.name, options)

    def wrap(self, model, optimizer, options, setup):  # type: ignore[no-untyped-def]
        """``optimizer`` as the inner optimizer of :class:`thinwire.DiLoCo` over ``model``."""
        rounds = build_rounds(
            self.name,
            optimizer,
            model,
            options,
            bucket_cap_mb=setup.bucket_cap_mb if is_real(setup.bucket_cap_mb) else 25.0,
            fuse_rounds=setup.fuse_rounds,
        )
        return Wrapped(model, rounds, rounds.engine, rounds.flush)


@register_strategy
class LocalSGDStrategy(Rounds):
    """Average the weights every ``sync_every`` steps."""

    name = "local-sgd"
    summary = "local SGD: H local steps, then the ranks' weights averaged (compressed)"
    defaults: ClassVar[Mapping[str, Any]] = defaults("local-sgd")


@register_strategy
class DiLoCoStrategy(Rounds):
    """DiLoCo: an outer Nesterov SGD step on the averaged pseudo-gradient every H steps."""

    name = "diloco"
    summary = "DiLoCo: H local steps, then an outer Nesterov step on the mean pseudo-gradient"
    defaults: ClassVar[Mapping[str, Any]] = defaults("diloco")
