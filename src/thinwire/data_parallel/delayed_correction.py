"""The closed-form correction of :class:`~thinwire.DelayedAveraging`: which optimizers it
covers (SGD, plain or with heavy-ball momentum), the momentum it carries into their buffers,
and how far a late gradient change moves the weights and the buffer
(:func:`correction_coefficients`). Optimizers it does not cover are replayed instead
(:mod:`thinwire.data_parallel.replay`)."""

from __future__ import annotations

from typing import Any

import torch


def correction_coefficients(rates: list[tuple[float, float, float]]) -> tuple[float, float]:
    """How far a gradient change ``delta`` at the first of these SGD steps moves the weights
    and the momentum buffer by the end of the last: ``(a, b)`` with ``w += a * delta`` and
    ``buf += b * delta``. ``rates`` holds each step's (learning rate, weight decay,
    momentum); the momentum may change from step to step, as under OneCycleLR.

    SGD (heavy ball, no dampening) steps ``buf_s = m_s buf_{s-1} + g_s + wd_s w_s`` and
    ``w_{s+1} = w_s - lr_s buf_s``, affine in ``(w, buf, g)`` with the same coefficients for
    every entry, so the change propagates as two scalars: at step t ``dbuf = 1`` and
    ``dw = -lr_t``; at each later step ``dbuf = m dbuf + wd dw``, then ``dw -= lr dbuf``.
    Without weight decay and with a constant momentum ``a = -sum_k lr_{t+k} m^k`` and
    ``b = m^j``.
    """
    moved, carried = 0.0, 0.0
    for index, (lr, weight_decay, momentum) in enumerate(rates):
        carried = 1.0 if index == 0 else momentum * carried + weight_decay * moved
        moved -= lr * carried
    return moved, carried


def closed_form(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether ``group``'s step is linear in the gradient, so a late average can be
    corrected in closed form: SGD, plain or with heavy-ball momentum."""
    return isinstance(optimizer, torch.optim.SGD) and not (
        group.get("nesterov", False) or group.get("dampening", 0.0) or group.get("maximize", False)
    )


def exact_momentum(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> float:
    """The momentum the correction carries into ``group``'s buffers: SGD's heavy-ball
    momentum (no dampening, no Nesterov); 0 for anything else (corrected as plain SGD)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return 0.0
    momentum = float(group.get("momentum", 0.0))
    if momentum and not group.get("nesterov", False) and not group.get("dampening", 0.0):
        return momentum
    return 0.0
