"""``--compute sleep``: stage times measured from the real model, a twin that only sleeps.

Sleeps last at least as long as asked, so the timing checks here are lower bounds, which
hold on any machine however loaded.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import Tensor, nn

from thinwire.bench.sleeping import profile_stages, sleeping_twin, stage_modules

pytestmark = pytest.mark.timeout(120)

DELAY = 0.03


class SlowForward(nn.Module):
    """Parameter-free work that takes ``DELAY`` seconds on the way forward."""

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(DELAY)
        return x


class _SlowBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        time.sleep(DELAY)
        return grad


class SlowBackward(nn.Module):
    """Parameter-free work that takes ``DELAY`` seconds on the way back."""

    def forward(self, x: Tensor) -> Tensor:
        return _SlowBack.apply(x)


def model() -> nn.Sequential:
    """first -> slow forward -> second -> slow backward -> third (names "0", "2", "4")."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), SlowForward(), nn.Linear(16, 16), SlowBackward(), nn.Linear(16, 4)
    )


def batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(5, 8, generator=generator), torch.randint(0, 4, (5,), generator=generator)


def test_stages_are_the_parameter_owners_in_forward_order_with_their_times() -> None:
    stages = profile_stages(model(), batch(), nn.functional.cross_entropy, steps=2)
    assert [s.name for s in stages] == ["0", "2", "4"]
    assert all(s.forward_s >= 0 and s.backward_s >= 0 for s in stages)
    # parameter-free work goes to the stage that comes after it, in each pass's own order
    assert stages[1].forward_s >= DELAY  # the slow forward runs between "0" and "2"
    assert stages[0].forward_s < DELAY and stages[2].forward_s < DELAY
    assert stages[1].backward_s >= DELAY  # backward: "4", slow backward, then "2"
    assert stages[0].backward_s < DELAY and stages[2].backward_s < DELAY


def test_a_shared_parameter_belongs_to_the_first_module_that_holds_it() -> None:
    net = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    net[1].weight = net[0].weight  # tied
    owners = stage_modules(net)
    assert list(owners) == ["0"]


def test_the_twin_hands_back_the_real_gradients_and_sleeps_the_measured_time() -> None:
    real = model()
    x, y = batch()
    nn.functional.cross_entropy(real(x), y).backward()
    expected = {name: p.grad.clone() for name, p in real.named_parameters()}
    real.zero_grad(set_to_none=True)
    weights = {name: p.detach().clone() for name, p in real.named_parameters()}

    stages = profile_stages(real, (x, y), nn.functional.cross_entropy, steps=1)
    twin = sleeping_twin(real, stages, (x, y), nn.functional.cross_entropy)
    for name, p in real.named_parameters():
        assert torch.equal(p.detach(), weights[name])  # the real step changed nothing
    for _ in range(2):  # the same gradients at every step
        began = time.perf_counter()
        out = twin(torch.randn(5, 8))
        assert out.shape == (5, 4) and not bool(out.detach().any())
        forward_done = time.perf_counter()
        twin.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(out, y).backward()
        backward_done = time.perf_counter()
        for name, p in real.named_parameters():
            assert torch.equal(p.grad, expected[name]), name
        assert forward_done - began >= sum(s.forward_s for s in stages)
        assert backward_done - forward_done >= sum(s.backward_s for s in stages)
    assert sum(s.forward_s for s in stages) >= DELAY
    assert sum(s.backward_s for s in stages) >= DELAY


def test_a_parameter_the_forward_pass_never_uses_is_refused() -> None:
    class WithSpare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = model(), nn.Linear(3, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.used(x)

    with pytest.raises(ValueError, match=r"\['unused'\].*every parameter used at every step"):
        profile_stages(WithSpare(), batch(), nn.functional.cross_entropy, steps=1)
    with pytest.raises(ValueError, match=r"steps must be >= 1, got 0"):
        profile_stages(model(), batch(), nn.functional.cross_entropy, steps=0)
