"""DiLoCo's methods by name, ``"diloco"`` and ``"local-sgd"``: their options, checked in one
place for the strategies of the same names and for a hybrid plan's ``dp_method``.

    options = method_options("diloco", {"sync_every": 50, "compressor": "fp16"})
    rounds = build_rounds("diloco", inner_optimizer, model, options, group=group)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from thinwire.compress.registry import compressor as build_compressor
from thinwire.data_parallel.local_steps import DiLoCo, check_settings

#: the options both methods take, and their defaults
ROUND_DEFAULTS: dict[str, Any] = {
    "sync_every": 100,
    "fragments": 1,
    "overlap": 0,
    "compressor": "none",
    "compressor_options": {},
}
#: each method's outer SGD: DiLoCo's (options of ``diloco``), local SGD's (fixed)
OUTER: dict[str, dict[str, Any]] = {
    "diloco": {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True},
    "local-sgd": {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False},
}
#: the names of the methods
ROUND_METHODS = tuple(OUTER)


def defaults(method: str) -> dict[str, Any]:
    """The options ``method`` takes, with their defaults (local SGD's outer SGD is fixed)."""
    return {**ROUND_DEFAULTS, **(OUTER[method] if method == "diloco" else {})}


def method_options(method: str, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``given`` over ``method``'s defaults, checked; unknown options, settings DiLoCo
    refuses and a compressor that applies momentum itself raise ``ValueError`` naming the
    method and what to use."""
    if method not in OUTER:
        raise ValueError(f"unknown round method {method!r}; choose one of {ROUND_METHODS}")
    given = dict(given or {})
    known = defaults(method)
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(
            f"method {method!r} has no option(s) {', '.join(unknown)}; its options are: "
            f"{', '.join(sorted(known))}"
        )
    merged = {**known, **given}
    outer = {**OUTER[method], **{k: merged[k] for k in OUTER[method] if k in merged}}
    try:
        check_settings(
            merged["sync_every"],
            outer["outer_lr"],
            outer["outer_momentum"],
            outer["nesterov"],
            merged["fragments"],
            merged["overlap"],
        )
        if not isinstance(merged["compressor_options"], Mapping):
            raise ValueError(
                f"compressor_options must be a dict, got {merged['compressor_options']!r}"
            )
        built = build_compressor(merged["compressor"], **merged["compressor_options"])
    except ValueError as error:
        raise ValueError(f"{method}: {error}") from None
    if built.applies_momentum:
        raise ValueError(
            f"{method}: compressor {merged['compressor']!r} applies momentum itself, which is "
            "for gradients; a pseudo-gradient's momentum is the outer optimizer's. Use topk "
            "(with error feedback) or another compressor"
        )
    return {**merged, **outer}


def build_rounds(
    method: str,
    optimizer: torch.optim.Optimizer,
    model: nn.Module | Iterable[tuple[str, nn.Parameter]],
    options: Mapping[str, Any],
    **wrapper: Any,
) -> DiLoCo:
    """:class:`~thinwire.DiLoCo` running ``method`` with ``options`` (checked here), with
    ``optimizer`` as its inner optimizer; ``wrapper``: DiLoCo's other arguments
    (``group``, ``bucket_cap_mb``, ...)."""
    o = method_options(method, options)
    return DiLoCo(
        optimizer,
        model,
        o["compressor"],
        sync_every=o["sync_every"],
        fragments=o["fragments"],
        overlap=o["overlap"],
        outer_lr=o["outer_lr"],
        outer_momentum=o["outer_momentum"],
        nesterov=o["nesterov"],
        **wrapper,
        **o["compressor_options"],
    )
