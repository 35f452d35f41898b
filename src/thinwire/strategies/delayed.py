"""Delayed gradient averaging: ``thinwire.DelayedAveraging`` (``dga``).

Options: ``delay`` (steps between a gradient and its average), ``lanes`` (exchanges in
flight at once, each on a process group of its own; stateless compressors only),
``compressor`` and ``compressor_options``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from thinwire.compress.base import Compressor, is_real
from thinwire.data_parallel.delayed import DelayedAveraging
from thinwire.strategies.base import Wrapped
from thinwire.strategies.carrying import CarriesCompressor, runs_in_order
from thinwire.strategies.registry import register_strategy


@register_strategy
class Delayed(CarriesCompressor):
    """Apply this rank's gradient now and the average ``delay`` steps later."""

    name = "dga"
    summary = "delayed gradient averaging: local step now, correction D steps later"
    costing = "wrapper"
    schedule = "dga"
    synchronised = False
    defaults: ClassVar[Mapping[str, Any]] = {
        "delay": 2,
        "lanes": 2,
        "compressor": "none",
        "compressor_options": {},
    }

    def check_compressor(self, options: dict[str, Any], built: Compressor) -> None:
        """Several lanes only for a compressor without state between steps."""
        if options["lanes"] > 1 and runs_in_order(built):
            raise ValueError(
                f"{self.name}: lanes={options['lanes']} runs several steps' exchanges at once, "
                f"but compressor {options['compressor']!r} carries state from one step to the "
                "next, so its steps must run in order: use lanes 1, or a stateless compressor "
                "(none, fp16, bf16)"
            )

    def wrap(self, model, optimizer, options, setup):  # type: ignore[no-untyped-def]
        """``optimizer`` wrapped in delayed averaging over ``model``'s gradients (its
        buckets as large as DDP's buckets when a size is set, else 25 MB)."""
        dga = DelayedAveraging(
            optimizer,
            model,
            options["compressor"],
            delay=options["delay"],
            lanes=options["lanes"],
            bucket_cap_mb=setup.bucket_cap_mb if is_real(setup.bucket_cap_mb) else 25.0,
            fuse_rounds=setup.fuse_rounds,
            **options["compressor_options"],
        )
        return Wrapped(model, dga, dga.engine, dga.flush)
