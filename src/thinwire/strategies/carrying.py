"""The strategies that carry a thinwire compressor of their own choosing (delayed averaging,
the parameter servers, the embedding strategies): their shared options ``compressor`` (a
thinwire compressor name, default ``none``) and ``compressor_options`` (a dict), and the
checks of the options they have in common."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from thinwire.compress.base import Compressor
from thinwire.compress.feedback import NoMemory
from thinwire.compress.registry import compressor as build_compressor
from thinwire.strategies.base import Strategy, check_count
from thinwire.strategies.compressed import DEFAULT_OPTIONS


class CarriesCompressor(Strategy):
    """A strategy whose exchange sends through ``options["compressor"]``."""

    def options(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The defaults updated with ``given``, checked; the compressor's options get the
        defaults thinwire's benchmarks record (:data:`DEFAULT_OPTIONS`)."""
        merged = super().options(given)
        own = DEFAULT_OPTIONS.get(merged["compressor"], {})
        return {**merged, "compressor_options": {**own, **merged["compressor_options"]}}

    def check(self, options: dict[str, Any], given: Mapping[str, Any]) -> None:
        """The checks every carrying strategy shares, then :meth:`check_more`."""
        name = self.name
        for key in ("delay", "staleness"):
            if key in options:
                check_count(name, key, options[key], 0)
        for key in ("lanes", "servers"):
            if key in options:
                check_count(name, key, options[key], 1)
        if not isinstance(options["compressor_options"], Mapping):
            raise ValueError(
                f"{name}: compressor_options must be a dict, got {options['compressor_options']!r}"
            )
        self.check_own(options)
        self.check_compressor(options, self.compressor(options))

    def check_own(self, options: dict[str, Any]) -> None:
        """Checks of this strategy's own options."""

    def check_compressor(self, options: dict[str, Any], built: Compressor) -> None:
        """Checks of this strategy's options against its compressor ``built``."""

    def compressor(self, options: Mapping[str, Any]) -> Compressor:
        """The compressor it sends through (an unknown name raises, listing the names)."""
        return build_compressor(options["compressor"], **options["compressor_options"])


def runs_in_order(built: Compressor) -> bool:
    """Whether ``built`` carries state from one step to the next (so its steps' exchanges
    must run one after another)."""
    return not (built.stateless and isinstance(built.make_memory(), NoMemory))
