"""The step's tail phases a sleeping bench run notes (thinwire.bench.step_phases)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from thinwire.bench.step_phases import StepPhases

pytestmark = pytest.mark.timeout(60)


class Wrapper:
    """Stands for thinwire's data-parallel wrapper: synchronize, then the inner step."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner
        self.synchronized = 0

    def synchronize(self) -> None:
        time.sleep(0.01)
        self.synchronized += 1

    def step(self) -> None:
        self.synchronize()
        self.optimizer.step()


def test_the_exchange_and_the_optimizer_step_are_noted_in_order() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    wrapper = Wrapper(torch.optim.SGD([weight], lr=0.5))
    phases = StepPhases(SimpleNamespace(optimizer=wrapper))
    wrapper.step()
    assert wrapper.synchronized == 1 and torch.equal(weight.detach(), torch.full((3,), 0.5))
    (exchange, step) = phases.events
    assert exchange[0] == "X" and step[0] == "O"
    assert exchange[2] - exchange[1] >= 0.01  # the exchange's own time
    assert exchange[2] <= step[1] <= step[2]


def test_a_plain_optimizer_notes_only_its_step() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    phases = StepPhases(SimpleNamespace(optimizer=optimizer))
    optimizer.step()
    optimizer.step()
    assert [kind for kind, _, _ in phases.events] == ["O", "O"]
    assert all(start <= end for _, start, end in phases.events)
