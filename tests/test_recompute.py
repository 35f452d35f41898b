"""Recomputation per stage, in one process: Merak's ratios, the blocks a ratio checkpoints,
plans and specs that carry ratios, and a stage that recomputes giving the gradients of one
that does not (dropout included) while holding less."""

from __future__ import annotations

import pytest
import torch

from thinwire.parallel import ParallelPlan
from thinwire.parallel.layout import read_layout
from thinwire.parallel.plan_spec import parse_plan
from thinwire.parallel.recompute import checkpointed_blocks, stage_aware_ratios
from thinwire.parallel.stages import StageModule
from thinwire.plan.activations import SavedActivations
from thinwire.tasks.transformer import TransformerConfig, TransformerLM

pytestmark = pytest.mark.timeout(120)


def test_stage_aware_ratios_follow_merak() -> None:
    # r_s = 1 - (1 - r0)(S - 1)/(S - s), s from 1, clamped at 0; the last stage 0
    assert stage_aware_ratios(0.75, 4) == pytest.approx((0.75, 0.625, 0.25, 0.0))
    assert stage_aware_ratios(1.0, 4) == (1.0, 1.0, 1.0, 0.0)
    assert stage_aware_ratios(0.5, 4) == pytest.approx((0.5, 0.25, 0.0, 0.0))
    assert stage_aware_ratios(0.3, 1) == (0.3,)
    with pytest.raises(ValueError, match="between 0 and 1"):
        stage_aware_ratios(1.5, 4)


def test_a_ratio_checkpoints_the_last_blocks_rounded_half_up() -> None:
    assert [checkpointed_blocks(r, 4) for r in (0, 0.1, 0.125, 0.5, 0.625, 1)] == [
        0, 0, 1, 2, 3, 4
    ]  # fmt: skip


def test_plans_carry_one_ratio_per_stage() -> None:
    assert ParallelPlan(pp=2, microbatches=2, recompute=1).recompute == (1.0, 1.0)
    assert ParallelPlan(pp=2, microbatches=2, recompute=0).recompute is None
    interleaved = ParallelPlan(pp=2, microbatches=2, schedule="interleaved-1f1b", recompute=0.5)
    assert interleaved.recompute == (0.5,) * 4
    with pytest.raises(ValueError, match="a ratio per pipeline stage: 2 of them, got 3"):
        ParallelPlan(pp=2, microbatches=2, recompute=(1, 1, 0))
    with pytest.raises(ValueError, match="between 0 and 1"):
        ParallelPlan(pp=2, microbatches=2, recompute=(1, -0.5))
    with pytest.raises(TypeError, match="one per stage"):
        ParallelPlan(pp=2, microbatches=2, recompute="all")


@pytest.mark.parametrize(
    "spec,ratios",
    [
        ("1x4x2/mb8/rc1", (1.0, 1.0, 1.0, 1.0)),
        ("1x4x2/mb8/rc1,0.5,0.5,0", (1.0, 0.5, 0.5, 0.0)),
        ("1x4x2/mb8/rcsa0.75", (0.75, 0.625, 0.25, 0.0)),
        ("2x1x1/mb2/rc.5", (0.5,)),
    ],
)
def test_specs_read_and_write_recomputation(spec, ratios) -> None:
    plan = parse_plan(spec)
    assert plan.recompute == pytest.approx(ratios)
    assert parse_plan(plan.spec()) == plan


def test_a_bad_recomputation_part_says_what_is_accepted() -> None:
    with pytest.raises(ValueError, match="rcsaR"):
        parse_plan("1x2x1/rcx")


def model() -> TransformerLM:
    torch.manual_seed(0)
    config = TransformerConfig(dim=32, layers=4, heads=4, dropout=0.2, vocab=64, max_seq=16)
    return TransformerLM(config)


def train_microbatches(ratio: float, early: bool) -> tuple[list, list[float], int, float]:
    """Forward four micro-batches, then their backwards (as GPipe does) on a whole-model
    stage recomputing ``ratio`` of its blocks; its gradients, losses, peak saved bytes and
    the next random number the step leaves behind."""
    source = model()
    stage = StageModule(source, read_layout(source), range(4), first=True, last=True,
                        recompute=ratio)  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (4, 4, 17), generator=generator)
    torch.manual_seed(2)
    with SavedActivations(exclude=list(stage.parameters())) as saved:
        losses = [
            torch.nn.functional.cross_entropy(stage(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten())
            for t in tokens
        ]
        for loss in losses:
            if early:
                assert stage.recomputation.recompute_next()
            loss.backward()
    assert not stage.recomputation.pending
    grads = [p.grad for p in stage.parameters()]
    return grads, [loss.item() for loss in losses], saved.peak_bytes, torch.rand(()).item()


@pytest.mark.parametrize("ratio,early", [(0.5, False), (1.0, False), (1.0, True)])
def test_recomputing_gives_the_same_gradients_with_dropout(ratio, early) -> None:
    grads, losses, peak, after = train_microbatches(0.0, False)
    recomputed = train_microbatches(ratio, early)
    assert recomputed[1] == losses
    for a, b in zip(grads, recomputed[0], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=0)
    assert recomputed[3] == after  # the random stream goes on as without recomputation
    assert recomputed[2] < peak


def test_without_dropout_the_same_random_draws_would_not_be_needed() -> None:
    # the check above can fail: dropping a different mask changes the gradients
    source = model()
    stage = StageModule(source, read_layout(source), range(4), first=True, last=True)
    tokens = torch.randint(0, 64, (2, 17))
    torch.manual_seed(3)
    first = stage(tokens[:, :-1])
    second = stage(tokens[:, :-1])
    assert not torch.equal(first, second)


def test_recomputation_replays_the_forwards_autocast() -> None:
    def grads(ratio: float) -> list[torch.Tensor]:
        source = model()
        stage = StageModule(source, read_layout(source), range(4), first=True, last=True,
                            recompute=ratio)  # fmt: skip
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(4))
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = stage(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), tokens[:, 1:].flatten()
        )
        loss.backward()  # outside autocast, as training loops do
        return [p.grad for p in stage.parameters()]

    for a, b in zip(grads(0.0), grads(1.0), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
