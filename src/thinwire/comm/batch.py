"""What the exchange engine holds of a bucket: its gradients (:class:`GradientItem`) and,
while they are in flight, their runs and verdicts (:class:`Batch`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from thinwire.comm.runs import Run
from thinwire.comm.survey import Survey
from thinwire.compress.finite import FiniteChecks


@dataclass(frozen=True)
class GradientItem:
    """One gradient to exchange: its stable ``key`` (parameter name), the gradient, and the
    parameter itself (for weight decay inside DGC's memory; may be ``None``)."""

    key: str
    grad: Tensor
    param: Tensor | None = None


@dataclass
class Batch:
    """The tensors of one exchange call (a bucket) in flight."""

    items: Sequence[GradientItem]
    runs: list[Run]
    not_finite: list[str]
    token: Any = None
    #: this rank's gradients of the batch were not finite: a bool, or a device flag
    poison: bool | Tensor = False
    #: the batch's finiteness checks (to name the tensors of a step refused later)
    checks: FiniteChecks | None = None
    #: what its items are (keys, sizes, dtype), and their gradients
    known: Survey | None = None
    grads: list[Tensor] | None = None

    @property
    def done(self) -> bool:
        """Whether every tensor's protocol has returned."""
        return all(run.done for run in self.runs)
