"""The optimizer step the planner times: on the gradients each method's exchange writes."""

from __future__ import annotations

import pytest
import torch

from thinwire.plan.optimizer_profile import exchanged_gradients, optimizer_step_s

pytestmark = pytest.mark.timeout(120)

SHAPES = [(64, 32), (32,), (16, 16)]


def test_a_dense_exchange_hands_on_the_gradients_it_was_given():
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    given = exchanged_gradients("none", {}, SHAPES, world_size=4, seed=3)
    generator = torch.Generator().manual_seed(3)
    for run in range(2):
        expected = torch.randn(numel, generator=generator).mul_(1e-3)
        got = torch.cat([g.reshape(-1) for g in given(run)])
        torch.testing.assert_close(got, expected)


def test_a_sparsifier_hands_on_gradients_that_are_zero_almost_everywhere():
    shapes = [(256, 128)]
    given = exchanged_gradients("dgc", {"density": 0.01, "warmup_steps": 0}, shapes, world_size=4)
    for run in range(3):
        (grad,) = given(run)
        assert grad.shape == (256, 128)
        nonzero = (grad != 0).float().mean().item()
        assert 0 < nonzero <= 0.02  # its selection (about 1 %), nothing densified


def test_the_step_takes_the_given_gradients_one_call_per_step():
    calls: list[int] = []
    zeros = [torch.zeros(s) for s in SHAPES]

    def gradients(run: int) -> list[torch.Tensor]:
        calls.append(run)
        return [z.clone() for z in zeros]

    seconds, state = optimizer_step_s("adamw", SHAPES, 3, gradients)
    assert calls == [0, 1, 2, 3]
    assert seconds > 0
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    assert state >= 2 * 4 * numel  # AdamW's two moments (and its step counters)
    _, sgd_state = optimizer_step_s("sgd", SHAPES, 1)
    assert sgd_state == 4 * numel  # the momentum buffer
    with pytest.raises(ValueError, match="adamw, sgd, not 'lamb'"):
        optimizer_step_s("lamb", SHAPES, 1)
