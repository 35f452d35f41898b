"""The bench's probe of an emulated cluster's links: timed dense all-reduces, one of the
model's size and two that separate the link's bandwidth from an all-reduce's fixed cost."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console

from thinwire.bench.worker import probe_allreduce
from thinwire.launch import LocalPool

if TYPE_CHECKING:
    from thinwire.bench.runner import BenchConfig

#: seconds of link time of the two all-reduces that separate bandwidth from fixed cost
LINK_PROBE_S = (0.5, 2.5)
#: ... but neither probe is larger than this many elements (128 MB per rank)
LINK_PROBE_MAX_NUMEL = 32 * 1024 * 1024
#: seconds of link time the model-sized all-reduce may take at the nominal rate; a bigger
#: model is probed with an all-reduce of this much (the image task's 11 MB at 100 kbit/s:
#: 22 minutes by the link's rate, and the probe runs each all-reduce twice)
MODEL_PROBE_MAX_S = 60.0


def measure_link(
    pool: LocalPool, config: BenchConfig, console: Console, rate_bps: float | None
) -> dict[str, Any]:
    """Time dense all-reduces on the links (sizes from :func:`probe_numels`): one of the
    model's size (the bandwidth the ring delivers to this model, latency included;
    ``allreduce_probe_bytes`` says how much was sent), and two whose difference is the
    link's bandwidth with the fixed cost of an all-reduce (its ring steps' latency) taken
    out."""
    from thinwire.tasks import task as build_task

    model = build_task(config.task, **config.task_options).build_model()
    share = 2 * (config.workers - 1) / config.workers  # of the payload each link carries
    numel, *fit = probe_numels(sum(p.numel() for p in model.parameters()), share, rate_bps)
    with console.status(f"measuring the links: all-reduces of {numel * 4 / 1e6:.1f} MB and more"):
        per_rank = pool.run(probe_allreduce, (numel, *fit), timeout=config.timeout_s)
    model_s, *fit_s = (max(times[i] for times in per_rank) for i in range(1 + len(fit)))
    delivered = share * numel * 4 * 8 / model_s
    link, fixed = (
        split_link_time(share * fit[0] * 4, fit_s[0], share * fit[1] * 4, fit_s[1])
        if fit
        else (None, None)
    )
    line = (
        f"all-reduce of {numel * 4 / 1e6:.1f} MB: {model_s:.3f} s, "
        f"{delivered / 1e6:.1f} Mbit/s per link delivered"
    )
    if link and fixed is not None:
        line += f"; the link: {link / 1e6:.1f} Mbit/s plus {fixed * 1e3:.1f} ms per all-reduce"
    console.print(line)
    return {
        "allreduce_probe_bytes": numel * 4,
        "allreduce_probe_s": model_s,
        "allreduce_bandwidth_bps": delivered,
        "allreduce_fit_bytes": [n * 4 for n in fit],
        "allreduce_fit_s": fit_s,
        "allreduce_link_bps": link,
        "allreduce_fixed_s": fixed,
    }


def probe_numels(model_numel: int, share: float, rate_bps: float | None) -> list[int]:
    """Elements of the link probe's all-reduces, each link carrying ``share`` of each:
    the model's (at most ``MODEL_PROBE_MAX_S`` seconds of link time at ``rate_bps``), then
    two that keep a link busy for about ``LINK_PROBE_S`` seconds (at most
    ``LINK_PROBE_MAX_NUMEL`` elements; none without a rate: nothing to aim a fit at)."""
    if not rate_bps:
        return [model_numel]

    def lasting(seconds: float) -> int:
        return max(int(rate_bps / 8 * seconds / share / 4), 1024)

    fit = [min(lasting(seconds), LINK_PROBE_MAX_NUMEL) for seconds in LINK_PROBE_S]
    return [min(model_numel, lasting(MODEL_PROBE_MAX_S)), *fit]


def split_link_time(
    small_bytes: float, small_s: float, big_bytes: float, big_s: float
) -> tuple[float | None, float | None]:
    """Fit ``seconds = fixed + bytes * 8 / bandwidth`` through two transfers (the bytes
    each link carries): ``(bandwidth_bps, fixed_s)``, or ``(None, None)`` when the bigger
    transfer was not slower (the measurement cannot separate the two)."""
    if not big_bytes > small_bytes or not big_s > small_s:
        return None, None
    bandwidth = (big_bytes - small_bytes) * 8 / (big_s - small_s)
    return bandwidth, small_s - small_bytes * 8 / bandwidth
