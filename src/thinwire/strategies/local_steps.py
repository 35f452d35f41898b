"""Synchronise every H steps: ``local-sgd`` (average the weights) and ``diloco`` (an outer
Nesterov step on the averaged pseudo-gradient), :class:`thinwire.DiLoCo` under the bench.

Options: ``sync_every`` (H, inner steps per round), ``fragments`` (parts of the model
exchanged at spread steps of a round), ``overlap`` (inner steps each exchange runs in the
background), ``compressor`` and ``compressor_options`` (the pseudo-gradient's, with error
feedback); ``diloco`` adds ``outer_lr``, ``outer_momentum`` and ``nesterov``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from thinwire.compress.base import Compressor, is_real
from thinwire.data_parallel.local_steps import DiLoCo, check_settings
from thinwire.strategies.base import Wrapped
from thinwire.strategies.carrying import CarriesCompressor
from thinwire.strategies.registry import register_strategy

#: the options both strategies share, and their defaults
ROUND_DEFAULTS: dict[str, Any] = {
    "sync_every": 100,
    "fragments": 1,
    "overlap": 0,
    "compressor": "none",
    "compressor_options": {},
}


class Rounds(CarriesCompressor):
    """What local SGD and DiLoCo share: rounds of ``sync_every`` local steps."""

    costing = "wrapper"
    schedule = "local"
    synchronised = False  # ranks wait for each other once per round: wall-clock throughput
    #: the outer SGD's settings (lr, momentum, Nesterov) where the strategy fixes them
    fixed_outer: ClassVar[Mapping[str, Any]] = {}

    def outer(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The outer SGD's settings."""
        return {
            "outer_lr": options.get("outer_lr", self.fixed_outer.get("outer_lr")),
            "outer_momentum": options.get("outer_momentum", self.fixed_outer.get("outer_momentum")),
            "nesterov": options.get("nesterov", self.fixed_outer.get("nesterov")),
        }

    def check_own(self, options: dict[str, Any]) -> None:
        """H, F, T and the outer settings as :class:`thinwire.DiLoCo` checks them."""
        try:
            outer = self.outer(options)
            check_settings(
                options["sync_every"],
                outer["outer_lr"],
                outer["outer_momentum"],
                outer["nesterov"],
                options["fragments"],
                options["overlap"],
            )
        except ValueError as error:
            raise ValueError(f"{self.name}: {error}") from None

    def check_compressor(self, options: dict[str, Any], built: Compressor) -> None:
        """No compressor that applies momentum itself: DGC's correction is for gradients,
        and the outer optimizer already holds the pseudo-gradients' momentum."""
        if built.applies_momentum:
            raise ValueError(
                f"{self.name}: compressor {options['compressor']!r} applies momentum itself, "
                "which is for gradients; a pseudo-gradient's momentum is the outer "
                "optimizer's. Use topk (with error feedback) or another compressor"
            )

    def wrap(self, model, optimizer, options, setup):  # type: ignore[no-untyped-def]
        """``optimizer`` as the inner optimizer of :class:`thinwire.DiLoCo` over ``model``."""
        outer = self.outer(options)
        rounds = DiLoCo(
            optimizer,
            model,
            options["compressor"],
            sync_every=options["sync_every"],
            fragments=options["fragments"],
            overlap=options["overlap"],
            outer_lr=outer["outer_lr"],
            outer_momentum=outer["outer_momentum"],
            nesterov=outer["nesterov"],
            bucket_cap_mb=setup.bucket_cap_mb if is_real(setup.bucket_cap_mb) else 25.0,
            fuse_rounds=setup.fuse_rounds,
            **options["compressor_options"],
        )
        return Wrapped(model, rounds, rounds.engine, rounds.flush)


@register_strategy
class LocalSGDStrategy(Rounds):
    """Average the weights every ``sync_every`` steps."""

    name = "local-sgd"
    summary = "local SGD: H local steps, then the ranks' weights averaged (compressed)"
    defaults: ClassVar[Mapping[str, Any]] = ROUND_DEFAULTS
    fixed_outer: ClassVar[Mapping[str, Any]] = {
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "nesterov": False,
    }


@register_strategy
class DiLoCoStrategy(Rounds):
    """DiLoCo: an outer Nesterov SGD step on the averaged pseudo-gradient every H steps."""

    name = "diloco"
    summary = "DiLoCo: H local steps, then an outer Nesterov step on the mean pseudo-gradient"
    defaults: ClassVar[Mapping[str, Any]] = {
        **ROUND_DEFAULTS,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "nesterov": True,
    }
