"""DDP's gradient buckets: its own layout, and a tapered one that ends in small buckets.

DDP reduces gradients in buckets, in the order the backward pass makes them ready, and a
bucket's exchange starts only once its last gradient is ready. The last bucket holds the
model's first layers, ready when the backward pass ends: its exchange overlaps nothing and
is added whole to the step. With a compressor of two dependent rounds (PowerSGD's P, then
Q) that tail costs two round trips of whatever the last bucket holds. A *tapered* layout
keeps buckets large where the backward pass still has time to hide their exchanges and
shrinks them towards its end, so that what is left after it is small. Limits, counted
from the end of the backward pass::

    tail, tail * f, tail * f**2, ..., cap, cap, ...

DDP takes one limit per bucket (``bucket_cap_mb_list``, in the order it reduces the
buckets, the last repeated) and closes a bucket once it holds at least its limit.
:func:`tapered_buckets` plans the buckets from the tail and gives each its planned size
as its limit, so that DDP's own filling reproduces the plan (for a model of one dtype whose
gradients become ready in reverse definition order, which DDP assumes too).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire.compress.base import is_real
from thinwire.data_parallel.parameters import split_parameters

MB = 2**20
#: the bucket layout that :func:`tapered_buckets` plans, as ``bucket_cap_mb`` takes it
TAPERED = "tapered"
#: the taper's defaults: the largest bucket (MB), the last bucket's least size (MB), and
#: how much larger each bucket before it may be
TAPER_CAP_MB, TAPER_TAIL_MB, TAPER_FACTOR = 25.0, 0.05, 4.0
#: DDP's default limits: a 1 MB first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``),
#: then 25 MB
DDP_DEFAULT_LIMITS_MB = (1.0, 25.0)

BucketSpec = float | str | None


def assign_buckets(sizes: Sequence[int], limits: Sequence[int]) -> list[list[int]]:
    """DDP's filling: the indices of ``sizes`` (bytes, in ready order) per bucket. Bucket
    ``i`` closes once it holds at least ``limits[i]`` bytes; the last limit repeats."""
    if not limits or any(limit <= 0 for limit in limits):
        raise ValueError(f"bucket limits must be > 0 bytes, got {list(limits)!r}")
    buckets: list[list[int]] = [[]]
    filled = 0
    for index, size in enumerate(sizes):
        buckets[-1].append(index)
        filled += size
        if filled >= limits[min(len(buckets) - 1, len(limits) - 1)]:
            buckets.append([])
            filled = 0
    return [b for b in buckets if b]


def tapered_limits(
    sizes: Sequence[int],
    *,
    cap_mb: float = TAPER_CAP_MB,
    tail_mb: float = TAPER_TAIL_MB,
    factor: float = TAPER_FACTOR,
) -> list[int]:
    """Per-bucket limits in bytes, in ready order, for parameters of ``sizes`` bytes (in
    ready order): buckets planned from the last one, of at least ``tail_mb``,
    ``tail_mb * factor``, ... up to ``cap_mb`` each; every limit is its bucket's size.
    What is left at the front makes a bucket of its own unless it is smaller than the
    target of the bucket after it, which it then joins."""
    check_taper(cap_mb, tail_mb, factor)
    planned: list[int] = []
    filled = 0
    limit = previous = tail_mb * MB
    for size in reversed(sizes):
        filled += size
        if filled >= limit:
            planned.append(filled)
            filled = 0
            previous, limit = limit, min(limit * factor, cap_mb * MB)
    if filled:
        # the first gradients ready: a bucket of their own, to start exchanging early,
        # unless they would be smaller than the bucket after them (then they join it)
        if planned and filled < previous:
            planned[-1] += filled
        else:
            planned.append(filled)
    return list(reversed(planned))


def check_taper(cap_mb: Any, tail_mb: Any, factor: Any) -> None:
    """Refuse a taper that cannot be planned, saying what to give instead."""
    if not (is_real(cap_mb) and cap_mb > 0):
        raise ValueError(f"cap_mb must be a number > 0, got {cap_mb!r}")
    if not (is_real(tail_mb) and 0 < tail_mb <= cap_mb):
        raise ValueError(f"tail_mb must be a number in (0, cap_mb={cap_mb}], got {tail_mb!r}")
    if not (is_real(factor) and factor > 1):
        raise ValueError(f"factor must be a number > 1 (how fast buckets grow), got {factor!r}")


def tapered_buckets(
    model: nn.Module | Iterable[tuple[str, nn.Parameter]],
    *,
    cap_mb: float = TAPER_CAP_MB,
    tail_mb: float = TAPER_TAIL_MB,
    factor: float = TAPER_FACTOR,
) -> list[float]:
    """Bucket limits for ``DistributedDataParallel(model, bucket_cap_mb_list=...)`` that
    end the backward pass with small buckets (see the module docstring)::

        ddp = DistributedDataParallel(model, bucket_cap_mb_list=thinwire.tapered_buckets(model))

    ``tail_mb``: the last bucket's least size; ``factor``: how much larger each bucket
    before it may be, up to ``cap_mb``. The parameters DDP averages are taken in reverse
    definition order (the order most backward passes produce their gradients).
    """
    averaged, _ = split_parameters(model)
    if not averaged:
        raise ValueError("the model has no parameters that require gradients")
    sizes = [p.numel() * p.element_size() for _, p in reversed(averaged)]
    return [
        limit / MB for limit in tapered_limits(sizes, cap_mb=cap_mb, tail_mb=tail_mb, factor=factor)
    ]


def taper_of(spec: Any, flag: str = "bucket_cap_mb") -> tuple[float, float] | None:
    """``(tail_mb, factor)`` of a tapered layout: ``"tapered"`` (the defaults of
    :func:`tapered_buckets`) or ``"tapered:TAIL:FACTOR"`` (e.g. ``"tapered:0.2:2"``);
    ``None`` for any other spec. A malformed taper is refused, saying what to give."""
    if not isinstance(spec, str) or spec.split(":")[0] != TAPERED:
        return None
    fields = spec.split(":")[1:]
    if not fields:
        return (TAPER_TAIL_MB, TAPER_FACTOR)
    try:
        tail_mb, factor = (float(field) for field in fields)
        check_taper(TAPER_CAP_MB, tail_mb, factor)
    except ValueError as error:
        raise ValueError(
            f"{flag} {spec!r}: a taper is {TAPERED!r} or '{TAPERED}:TAIL:FACTOR', the last "
            f"bucket's least size in MB (0 < TAIL <= {TAPER_CAP_MB:g}) and how much larger "
            f"each bucket before it may be (FACTOR > 1), e.g. '{TAPERED}:0.2:2' ({error})"
        ) from None
    return (tail_mb, factor)


def check_bucket_spec(spec: Any, flag: str = "bucket_cap_mb") -> None:
    """Refuse a bucket layout other than ``None`` (DDP's own), a size in MB > 0 or a
    taper (:func:`taper_of`)."""
    if spec is None or taper_of(spec, flag) is not None:
        return
    if not (is_real(spec) and spec > 0):
        raise ValueError(
            f"{flag} must be a size in MB > 0 or {TAPERED!r} (large buckets first, small "
            f"ones at the end of the backward pass; '{TAPERED}:TAIL:FACTOR' to choose the "
            f"taper), got {spec!r}"
        )


def parse_bucket_spec(text: str) -> float | str:
    """A command line's ``--bucket-cap-mb``: a number, ``tapered`` or
    ``tapered:TAIL:FACTOR``."""
    spec = text.strip().lower()
    if spec.split(":")[0] == TAPERED:
        taper_of(spec, "--bucket-cap-mb")
        return spec
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"--bucket-cap-mb must be a size in MB, {TAPERED!r} or '{TAPERED}:TAIL:FACTOR', "
            f"got {text!r}"
        ) from None
    check_bucket_spec(value, "--bucket-cap-mb")
    return value


def bucket_limits_mb(spec: BucketSpec, sizes: Sequence[int]) -> list[float]:
    """The per-bucket limits (MB, ready order, last repeated) DDP uses under ``spec`` for
    parameters of ``sizes`` bytes in ready order: its default 1 MB then 25 MB, one size
    given (the first bucket's too, as DDP does), or the taper."""
    check_bucket_spec(spec)
    if spec is None:
        return list(DDP_DEFAULT_LIMITS_MB)
    taper = taper_of(spec)
    if taper is not None:
        tail_mb, factor = taper
        return [limit / MB for limit in tapered_limits(sizes, tail_mb=tail_mb, factor=factor)]
    return [float(spec)]


def takes_bucket_lists() -> bool:
    """Whether this torch's DDP takes per-bucket limits (``bucket_cap_mb_list``)."""
    return "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters


def ddp_bucket_options(spec: BucketSpec, model: nn.Module) -> dict[str, Any]:
    """The ``DistributedDataParallel`` keyword arguments for bucket layout ``spec``."""
    check_bucket_spec(spec)
    if spec is None:
        return {}
    taper = taper_of(spec)
    if taper is None:
        return {"bucket_cap_mb": spec}
    if not takes_bucket_lists():
        raise ValueError(
            f"tapered buckets need DistributedDataParallel(bucket_cap_mb_list=...), which "
            f"torch {torch.__version__} lacks: upgrade torch, or give a size in MB instead"
        )
    tail_mb, factor = taper
    return {"bucket_cap_mb_list": tapered_buckets(model, tail_mb=tail_mb, factor=factor)}
