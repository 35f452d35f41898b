"""DDP's gradient buckets, as the cost model takes them: :func:`ddp_buckets` (after DDP's
first-iteration rebuild: in the order gradients become ready, the first one capped at
1 MiB, the others at 25 MiB, or one limit per bucket), :func:`bucket_groups` for a
``bucket_cap_mb`` as the bench takes it (a size, or ``"tapered"``), and :class:`Bucket`,
one bucket's buffer as a DDP hook sees it, with the :data:`Exchanger` type that exchanges
one."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from thinwire.data_parallel.buckets import (
    DDP_DEFAULT_LIMITS_MB,
    MB,
    BucketSpec,
    assign_buckets,
    bucket_limits_mb,
)
from thinwire.plan.network import Collective

#: DDP's defaults (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` and ``bucket_cap_mb``)
FIRST_BUCKET_MB, BUCKET_CAP_MB = DDP_DEFAULT_LIMITS_MB

NamedTensors = Sequence[tuple[str, Tensor]]


def ddp_buckets(
    params: NamedTensors,
    order: Sequence[str] | None = None,
    *,
    bucket_cap_mb: float = BUCKET_CAP_MB,
    first_bucket_mb: float = FIRST_BUCKET_MB,
    limits_mb: Sequence[float] | None = None,
) -> list[list[str]]:
    """DDP's buckets of ``params`` (names), in the order DDP reduces them.

    Parameters are taken in gradient-ready ``order`` (default: reverse definition order,
    what the backward pass usually produces); a bucket closes once it holds at least its
    limit: ``first_bucket_mb`` for the first, ``bucket_cap_mb`` for the others (DDP's
    rebuilt buckets after the first iteration, for one dtype and device), or
    ``limits_mb[i]`` for bucket ``i``, the last repeated (DDP's ``bucket_cap_mb_list``).
    """
    if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
        raise ValueError(
            f"bucket sizes must be > 0 MB, got bucket_cap_mb={bucket_cap_mb}, "
            f"first_bucket_mb={first_bucket_mb}"
        )
    sizes = {name: t.numel() * t.element_size() for name, t in params}
    names = _ready_names(params, order)
    limits = [first_bucket_mb, bucket_cap_mb] if limits_mb is None else list(limits_mb)
    groups = assign_buckets([sizes[n] for n in names], [int(limit * MB) for limit in limits])
    return [[names[i] for i in group] for group in groups]


def _ready_names(params: NamedTensors, order: Sequence[str] | None) -> list[str]:
    """``params``' names in ready ``order`` (default: reverse definition order), checked."""
    known = {name for name, _ in params}
    names = list(order) if order is not None else [n for n, _ in reversed(params)]
    missing = known - set(names)
    if missing or len(names) != len(known) or set(names) != known:
        raise ValueError(
            f"order must name each of the {len(known)} parameters once; "
            f"missing {sorted(missing)[:5]}, got {len(names)} names"
        )
    return names


def bucket_groups(
    params: NamedTensors, order: Sequence[str] | None, spec: BucketSpec
) -> list[list[str]]:
    """DDP's buckets (names, reduction order) under ``bucket_cap_mb`` = ``spec``: DDP's
    default (``None`` or :data:`BUCKET_CAP_MB`: a 1 MB first bucket, then 25 MB), one
    size given explicitly (the first bucket's too, as DDP does), or a taper
    (``"tapered"``, ``"tapered:TAIL:FACTOR"``: :func:`thinwire.tapered_buckets`)."""
    if spec == BUCKET_CAP_MB:
        spec = None
    sizes = {name: t.numel() * t.element_size() for name, t in params}
    names = _ready_names(params, order)
    limits = bucket_limits_mb(spec, [sizes[n] for n in names])
    return ddp_buckets(params, names, limits_mb=limits)


class Bucket:
    """A DDP-style bucket: one flat fp32 buffer, a view per parameter."""

    def __init__(self, index: int, params: Sequence[tuple[str, Tensor]]) -> None:
        self.index = index
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.numel = sum(p.numel() for p in self.params)
        self.buffer = torch.empty(self.numel, dtype=torch.float32)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()

    def fill(self, generator: torch.Generator) -> None:
        """Fresh random gradients (small, like real ones)."""
        self.buffer.copy_(torch.randn(self.numel, generator=generator)).mul_(1e-3)

    def store(self, means: Sequence[Tensor]) -> None:
        """Write the averaged gradients into the bucket, as a DDP hook's future does."""
        for view, mean in zip(self.views, means, strict=True):
            view.copy_(mean)


#: exchanges one bucket: ``(bucket, run, last)`` -> the collectives it issued (``run``: the
#: step's index; ``last``: the step's last bucket); the averaged gradients land in the bucket
Exchanger = Callable[[Bucket, int, bool], list[Collective]]
