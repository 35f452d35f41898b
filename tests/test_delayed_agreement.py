"""Delayed Gradient Averaging: D = 0 is synchronous SGD; with D > 0 ranks agree after flush()."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import thinwire
from delayed_cases import flat, seeded_model
from thinwire.data_parallel.delayed import correction_coefficients

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

BUCKET_MB = 1e-4  # about 105 bytes: the 4 parameters of the model go in 4 buckets
#: a learning-rate schedule that changes every step, so the correction's lr matters
SCHEDULE = (0.1, 0.05, 0.2, 0.1, 0.15, 0.08, 0.12, 0.1)
MOMENTA = (0.85, 0.95, 0.9, 0.8, 0.95)  # per step, as OneCycleLR cycles it


@dataclass(frozen=True)
class Run:
    """One training run on every rank: front end, compressor, delay and data."""

    front_end: str = "delayed"  # or "sync": thinwire.DistributedOptimizer
    compressor: str = "none"
    options: dict = field(default_factory=dict)
    delay: int = 2
    steps: int = len(SCHEDULE)
    same_data: bool = False
    lanes: int = 1
    momentum: float = 0.0
    fuse_rounds: bool = True
    optimizer: str = "sgd"  # or "adam", "nesterov", "maximize": no closed form (replayed)
    subset: bool = False  # average only the first layer; the optimizer steps every layer
    tensor_lr: bool = False  # the learning rate is a tensor, updated in place
    weight_decay: float = 0.0  # SGD's
    momentum_schedule: bool = False  # the momentum changes every step, as OneCycleLR's


def _optimizer(run: Run, params) -> torch.optim.Optimizer:
    if run.optimizer == "adam":
        lr = torch.tensor(SCHEDULE[0] / 10) if run.tensor_lr else SCHEDULE[0] / 10
        return torch.optim.Adam(params, lr=lr)
    if run.optimizer == "nesterov":
        return torch.optim.SGD(params, lr=SCHEDULE[0], momentum=0.9, nesterov=True)
    if run.optimizer == "maximize":
        return torch.optim.SGD(params, lr=SCHEDULE[0], momentum=0.9, maximize=True)
    return torch.optim.SGD(
        params, lr=SCHEDULE[0], momentum=run.momentum, weight_decay=run.weight_decay
    )


def _state(optimizer: torch.optim.Optimizer) -> np.ndarray:
    """Every tensor of the optimizer's per-parameter state, flattened, in a fixed order."""
    values = [
        torch.as_tensor(value, dtype=torch.float32)
        for state in optimizer.state.values()
        for _, value in sorted(state.items())
    ]
    return flat(values) if values else np.zeros(0, dtype=np.float32)


def train(rank: int, world: int, run: Run) -> dict:
    """Train ``run.steps`` steps (plain SGD unless ``run.optimizer`` says otherwise);
    record this rank's gradient, learning rate and weights at every step, the weights
    after ``flush()`` and what was pending."""
    model = seeded_model()
    sgd = _optimizer(run, model.parameters())
    scale = float(sgd.param_groups[0]["lr"]) / SCHEDULE[0]
    averaged: Any = list(model.named_parameters())[:2] if run.subset else model
    if run.front_end == "sync":
        opt = thinwire.DistributedOptimizer(
            sgd, averaged, run.compressor, bucket_cap_mb=BUCKET_MB, **run.options
        )
    else:
        opt = thinwire.DelayedAveraging(
            sgd,
            averaged,
            run.compressor,
            delay=run.delay,
            lanes=run.lanes,
            bucket_cap_mb=BUCKET_MB,
            fuse_rounds=run.fuse_rounds,
            **run.options,
        )
    record: dict = {"w0": flat(model.parameters()), "grads": [], "lrs": [], "weights": []}
    for step in range(run.steps):
        lr = SCHEDULE[step % len(SCHEDULE)] * scale
        for group in opt.param_groups:
            if run.tensor_lr:
                group["lr"].fill_(lr)  # as torch's schedulers update a tensor rate
            else:
                group["lr"] = lr
            if run.momentum_schedule:
                group["momentum"] = MOMENTA[step % len(MOMENTA)]
        data = torch.Generator().manual_seed(1000 * step + (0 if run.same_data else rank + 1))
        x, y = torch.randn(5, 6, generator=data), torch.randn(5, 3, generator=data)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        record["grads"].append(flat(p.grad for p in model.parameters()))
        record["lrs"].append(lr)
        opt.step()
        record["weights"].append(flat(model.parameters()))
    if run.front_end == "delayed":
        record["pending"] = opt.pending
        opt.flush()
        record["collectives"] = opt.last_step.collectives
    record["final"] = flat(model.parameters())
    record["state"] = _state(sgd)
    return record


def sync_and_delayed(rank: int, world: int, run: Run) -> tuple[dict, dict]:
    """The same run through DistributedOptimizer, then through DelayedAveraging."""
    sync = train(rank, world, dataclasses.replace(run, front_end="sync"))
    return sync, train(rank, world, run)


def _consensus(record: dict, delay: int, step: int) -> np.ndarray:
    """``w_{t+1} + sum over the last D steps of lr_s g_s``: what the ranks must agree on."""
    own = sum(
        (record["lrs"][s] * record["grads"][s] for s in range(max(0, step - delay + 1), step + 1)),
        np.zeros_like(record["w0"]),
    )
    return record["weights"][step] + own


# -- D = 0 is synchronous data parallelism --------------------------------------------------


@pytest.mark.parametrize(
    ("compressor", "options"),
    [("none", {}), ("fp16", {}), ("powersgd", {"rank": 2}), ("topk", {"density": 0.3})],
)
def test_delay_zero_equals_distributed_optimizer_bitwise(
    pool, compressor: str, options: dict
) -> None:
    run = Run(compressor=compressor, options=options, delay=0)
    for sync, delayed in pool.run(sync_and_delayed, run):
        assert delayed["pending"] == 0
        for step, (a, b) in enumerate(zip(sync["weights"], delayed["weights"])):
            assert np.array_equal(a, b), f"{compressor}: weights differ after step {step}"


def test_identical_data_makes_any_delay_synchronous(pool) -> None:
    """Every rank's gradient is the average, so every correction is zero."""
    for sync, delayed in pool.run(sync_and_delayed, Run(delay=3, same_data=True)):
        for a, b in zip(sync["weights"], delayed["weights"]):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


# -- D > 0: agreement on everything older than D steps --------------------------------------


@pytest.mark.parametrize("delay", [1, 3])
def test_momentum_is_corrected_too_so_ranks_agree_after_flush(pool, delay: int) -> None:
    records = pool.run(train, Run(delay=delay, momentum=0.9))
    for record in records[1:]:
        np.testing.assert_allclose(record["final"], records[0]["final"], rtol=1e-5, atol=1e-6)
    # before the flush they did differ: the last D steps were each rank's own
    assert not np.allclose(records[0]["weights"][-1], records[1]["weights"][-1], atol=1e-4)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_weight_decay_is_corrected_too_so_ranks_agree_after_flush(pool2, momentum) -> None:
    """Weight decay acts on each rank's own weights, which differ by the pending steps; the
    correction carries that through, so after flush the ranks agree (they did not when
    the correction ignored the decay: 1e-3 apart here)."""
    records = pool2.run(train, Run(delay=3, momentum=momentum, weight_decay=0.5))
    np.testing.assert_allclose(records[1]["final"], records[0]["final"], rtol=0, atol=1e-6)
    assert np.abs(records[0]["weights"][-1] - records[1]["weights"][-1]).max() > 1e-3


@pytest.mark.parametrize("delay", [1, 3])
def test_a_momentum_schedule_is_followed_so_ranks_agree_after_flush(pool2, delay: int) -> None:
    """OneCycleLR changes SGD's momentum every step; the correction used the momentum the
    optimizer was built with, and the ranks ended 0.05 apart."""
    records = pool2.run(train, Run(delay=delay, momentum=0.9, momentum_schedule=True))
    np.testing.assert_allclose(records[1]["final"], records[0]["final"], rtol=0, atol=1e-6)
    assert np.abs(records[0]["weights"][-1] - records[1]["weights"][-1]).max() > 1e-3


@settings(max_examples=60, deadline=None)
@given(
    rates=st.lists(
        st.tuples(st.floats(0.001, 0.5), st.sampled_from([0.0, 1e-4, 0.01, 0.3])),
        min_size=1,
        max_size=6,
    ),
    momenta=st.sampled_from([[0.0], [0.5], [0.9], [0.85, 0.9, 0.95], [0.95, 0.5]]),
    delta=st.floats(-2.0, 2.0).filter(lambda d: abs(d) > 0.1),
)
def test_correction_coefficients_are_what_torch_sgd_does_with_a_changed_gradient(
    rates, momenta, delta
) -> None:
    """Run torch's SGD over the same gradients twice, the first one changed by ``delta``:
    the weights and buffer end ``a * delta`` and ``b * delta`` apart (with the momentum
    constant, or changing every step as a schedule changes it)."""
    steps = [(lr, decay, momenta[i % len(momenta)]) for i, (lr, decay) in enumerate(rates)]

    def run(first_change: float) -> tuple[float, float]:
        w = torch.tensor([0.7], dtype=torch.float64, requires_grad=True)
        sgd = torch.optim.SGD([w], lr=rates[0][0], momentum=momenta[0])
        for step, (lr, decay, momentum) in enumerate(steps):
            sgd.param_groups[0].update(lr=lr, weight_decay=decay, momentum=momentum)
            change = first_change if step == 0 else 0.0
            w.grad = torch.tensor([0.3 - 0.1 * step + change], dtype=torch.float64)
            sgd.step()
        buf = sgd.state[w].get("momentum_buffer")
        return float(w.detach()), float(buf) if buf is not None else 0.0

    (w0, b0), (w1, b1) = run(0.0), run(delta)
    moved, carried = correction_coefficients(steps)
    assert w1 - w0 == pytest.approx(moved * delta, rel=1e-9, abs=1e-12)
    if momenta[0]:
        assert b1 - b0 == pytest.approx(carried * delta, rel=1e-9, abs=1e-12)


def test_identical_data_with_momentum_is_synchronous_momentum_sgd(pool) -> None:
    run = Run(delay=2, same_data=True, momentum=0.9)
    for sync, delayed in pool.run(sync_and_delayed, run):
        for a, b in zip(sync["weights"], delayed["weights"], strict=True):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


@pytest.mark.parametrize("compressor", ["none", "fp16"])
def test_exchanges_in_flight_on_several_lanes_change_nothing_but_the_timing(
    pool, compressor: str
) -> None:
    one_lane = pool.run(train, Run(delay=3, compressor=compressor))
    three_lanes = pool.run(train, Run(delay=3, lanes=3, compressor=compressor))
    for a, b in zip(one_lane, three_lanes, strict=True):
        for step, (x, y) in enumerate(zip(a["weights"], b["weights"], strict=True)):
            assert np.array_equal(x, y), f"weights differ after step {step}"
        assert np.array_equal(a["final"], b["final"])


@pytest.mark.parametrize(
    ("compressor", "options", "unfused"),
    [
        ("powersgd", {"rank": 1}, 6),  # 2 rounds per weight, biases sent dense in 1
        ("terngrad", {}, 8),  # 2 rounds per tensor
        ("topk", {"density": 0.3}, 4),  # 1 round: nothing to fuse
    ],
)
def test_fused_rounds_train_the_same_with_fewer_collectives(
    pool2, compressor: str, options: dict, unfused: int
) -> None:
    """Each bucket's later rounds sent with the next bucket's first: the same averages
    (up to the fused buffers' rounding order), B + 1 collectives a step for B = 4 buckets
    of several rounds instead of one per round of each bucket."""
    run = Run(compressor=compressor, options=options, delay=1)
    fused = pool2.run(train, run)
    alone = pool2.run(train, dataclasses.replace(run, fuse_rounds=False))
    for a, b in zip(fused, alone, strict=True):
        np.testing.assert_allclose(a["final"], b["final"], rtol=0, atol=1e-5)
        assert b["collectives"] == unfused
        assert a["collectives"] == (unfused if unfused == 4 else 5)


@pytest.mark.parametrize("delay", [1, 3])
def test_ranks_agree_on_everything_older_than_the_delay(pool, delay: int) -> None:
    records = pool.run(train, Run(delay=delay))
    world = len(records)
    w0 = records[0]["w0"]
    mean_grads = [sum(r["grads"][s] for r in records) / world for s in range(len(SCHEDULE))]
    lrs = records[0]["lrs"]
    for step in range(len(SCHEDULE)):
        # w_{t+1}^i + sum_{t-D < s <= t} lr_s g_s^i = w_0 - sum_{s <= t-D} lr_s avg_s
        agreed = w0 - sum((lrs[s] * mean_grads[s] for s in range(step - delay + 1)), 0 * w0)
        for rank, record in enumerate(records):
            np.testing.assert_allclose(
                _consensus(record, delay, step),
                agreed,
                rtol=0,
                atol=2e-6,
                err_msg=f"rank {rank}, step {step}, delay {delay}",
            )
    # The test has teeth: before flush() the ranks' weights really differ ...
    assert np.abs(records[0]["weights"][-1] - records[1]["weights"][-1]).max() > 1e-3
    assert all(r["pending"] == delay for r in records)
    # ... and after it every rank holds w_0 - sum_s lr_s avg_s.
    synchronous = w0 - sum(lr * g for lr, g in zip(lrs, mean_grads))
    for record in records:
        np.testing.assert_allclose(record["final"], synchronous, rtol=0, atol=2e-6)
        np.testing.assert_allclose(record["final"], records[0]["final"], rtol=0, atol=1e-6)


def _adam_on(grads: list[np.ndarray], lrs: list[float]) -> np.ndarray:
    """Adam from w_0 on ``grads`` in turn, each with its step's learning rate."""
    model = seeded_model()
    adam = torch.optim.Adam(model.parameters())
    for grad, lr in zip(grads, lrs, strict=True):
        offset = 0
        for p in model.parameters():
            p.grad = torch.from_numpy(grad[offset : offset + p.numel()]).view_as(p).clone()
            offset += p.numel()
        adam.param_groups[0]["lr"] = lr
        adam.step()
    return flat(model.parameters())


@pytest.mark.parametrize("delay", [1, 3])
def test_adam_is_replayed_on_the_consensus_so_ranks_agree_after_flush(pool, delay: int) -> None:
    """Adam has no closed-form correction: each rank holds the consensus (Adam on the
    averages alone) plus its own last D steps, and after flush() the consensus itself,
    the same weights and moments on every rank."""
    records = pool.run(train, Run(delay=delay, optimizer="adam"))
    steps, lrs = len(SCHEDULE), records[0]["lrs"]
    averages = [sum(r["grads"][s] for r in records) / len(records) for s in range(steps)]
    expected = _adam_on(averages, lrs)
    for record in records:
        np.testing.assert_allclose(record["final"], expected, rtol=0, atol=2e-6)
        np.testing.assert_array_equal(record["final"], records[0]["final"])
        np.testing.assert_array_equal(record["state"], records[0]["state"])
    # before the flush: the averages of all but the last D steps, then this rank's own
    for rank, record in enumerate(records):
        own = averages[: steps - delay] + record["grads"][steps - delay :]
        np.testing.assert_allclose(
            record["weights"][-1], _adam_on(own, lrs), rtol=0, atol=2e-6, err_msg=f"rank {rank}"
        )
    assert np.abs(records[0]["weights"][-1] - records[1]["weights"][-1]).max() > 1e-3


@pytest.mark.parametrize(
    "run",
    [
        Run(delay=2, same_data=True, optimizer="adam", subset=True),
        Run(delay=2, same_data=True, optimizer="adam", tensor_lr=True),
    ],
    ids=["a-layer-not-averaged", "a-tensor-learning-rate"],
)
def test_replay_keeps_local_parameters_and_in_place_schedules(pool2, run: Run) -> None:
    """A parameter the optimizer steps but the model argument leaves out trains on its own
    gradient, as under DistributedOptimizer; a tensor learning rate that a scheduler
    updates in place is replayed with each step's value."""
    for sync, delayed in pool2.run(sync_and_delayed, run):
        for a, b in zip(sync["weights"], delayed["weights"], strict=True):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
        np.testing.assert_allclose(delayed["final"], sync["final"], rtol=0, atol=1e-6)
        assert np.abs(sync["final"] - sync["w0"]).max() > 1e-3


def test_maximizing_sgd_is_replayed_so_ranks_agree_after_flush(pool2) -> None:
    records = pool2.run(train, Run(delay=1, optimizer="maximize"))
    np.testing.assert_allclose(records[1]["final"], records[0]["final"], rtol=0, atol=1e-6)
    assert np.abs(records[0]["weights"][-1] - records[1]["weights"][-1]).max() > 1e-3


@pytest.mark.parametrize("optimizer", ["adam", "nesterov"])
def test_identical_data_makes_a_replayed_optimizer_synchronous(pool2, optimizer: str) -> None:
    """Every rank's gradient is the average, so replaying its own steps on the consensus
    gives the synchronous weights at every step."""
    run = Run(delay=2, same_data=True, optimizer=optimizer)
    for sync, delayed in pool2.run(sync_and_delayed, run):
        for a, b in zip(sync["weights"], delayed["weights"], strict=True):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
        np.testing.assert_allclose(delayed["state"], sync["state"], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("compressor", "options"),
    [
        ("fp16", {}),
        ("powersgd", {"rank": 1}),
        ("topk", {"density": 0.3}),
        ("dgc", {"density": 0.3, "weight_decay": 1e-2}),
    ],
)
def test_delayed_compressed_exchange_keeps_ranks_in_agreement(
    pool2, compressor: str, options: dict
) -> None:
    """With any compressor the average is identical on every rank, so the invariant holds
    (its average is the compressor's, not the exact one) and flush() makes ranks equal."""
    records = pool2.run(train, Run(compressor=compressor, options=options, delay=2))
    for step in range(len(SCHEDULE)):
        np.testing.assert_allclose(
            _consensus(records[1], 2, step),
            _consensus(records[0], 2, step),
            rtol=0,
            atol=2e-6,
            err_msg=f"{compressor}: step {step}",
        )
    np.testing.assert_allclose(records[1]["final"], records[0]["final"], rtol=0, atol=1e-6)
    assert np.abs(records[0]["final"] - records[0]["w0"]).max() > 1e-3  # it trained
