"""DiLoCo and local SGD: H = 1 with outer SGD lr 1 is synchronous averaging, the outer step
is DiLoCo's on the averaged pseudo-gradient, every rank holds the same weights after each
outer step, compression's residuals carry over between outer steps, fragments and
overlap keep nothing twice and lose nothing, and a checkpoint resumes bit for bit."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import thinwire
from thinwire.data_parallel.local_steps import split_evenly
from thinwire.errors import RankMismatchError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _model(batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)]
    if batch_norm:
        layers.insert(1, nn.BatchNorm1d(8))
    return nn.Sequential(*layers)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=generator), torch.randint(0, 3, (5,), generator=generator)


def _train_step(model: nn.Module, opt, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _gathered(array: np.ndarray) -> list[np.ndarray]:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, array)
    return out


# -- runs on every rank ---------------------------------------------------------------------


def _h1_against_sync(rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    model = _model()
    local = thinwire.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, sync_every=1)
    twin = _model()
    sync = thinwire.DistributedOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1), twin)
    for step in range(6):
        _train_step(model, local, rank, step)
        _train_step(twin, sync, rank, step)
    return _flat(model), _flat(twin)


def _diloco_against_reference(rank: int, world: int, steps: int, sync_every: int) -> dict:
    model = _model()
    opt = thinwire.DiLoCo(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5),
        model,
        sync_every=sync_every,
        outer_lr=0.7,
        outer_momentum=0.9,
    )
    spread = []
    for step in range(steps):
        _train_step(model, opt, rank, step)
        views = _gathered(_flat(model))
        spread.append(max(float(np.abs(v - views[0]).max()) for v in views))
    return {"weights": _flat(model), "spread": spread, "synced": opt.synced}


def _reference_diloco(world: int, steps: int, sync_every: int) -> np.ndarray:
    """DiLoCo in one process: ``world`` inner SGD optimizers, an outer Nesterov SGD on the
    mean of their pseudo-gradients."""
    global_model = _model()
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    workers = [copy.deepcopy(global_model) for _ in range(world)]
    inner = [torch.optim.SGD(w.parameters(), lr=0.05, momentum=0.5) for w in workers]
    for step in range(steps):
        for rank, (w, o) in enumerate(zip(workers, inner, strict=True)):
            _train_step(w, o, rank, step)
        if (step + 1) % sync_every == 0:
            with torch.no_grad():
                for index, g in enumerate(global_model.parameters()):
                    locals_ = [list(w.parameters())[index] for w in workers]
                    g.grad = sum(g - p for p in locals_) / world
            outer.step()
            for w in workers:
                w.load_state_dict(global_model.state_dict())
    return _flat(global_model)


def _residuals_carry(rank: int, world: int, carry: bool) -> dict:
    """LocalSGD through top-k: the global weights moved by what was applied; that plus the
    ranks' mean residual must equal the sum of the mean pseudo-gradients (``carry`` False:
    the residuals are dropped after each outer step, the control)."""
    model = _model()
    opt = thinwire.LocalSGD(
        torch.optim.SGD(model.parameters(), lr=0.1), model, "topk", sync_every=2, density=0.2
    )
    anchors = opt.fragments[0].anchors
    start = [a.detach().clone() for a in anchors]
    meant = [torch.zeros_like(a) for a in anchors]
    exchange = opt.fragments[0].exchange
    original = exchange.start_synchronize

    def capture():  # the pseudo-gradients, as the exchange is handed them
        for m, a in zip(meant, anchors, strict=True):
            m += a.grad
        if not carry:
            for r in exchange.engine.memory.residuals.values():
                r.zero_()
        return original()

    exchange.start_synchronize = capture
    for step in range(8):
        _train_step(model, opt, rank, step)
    names = [name for name, _ in opt.fragments[0].params]
    residuals = exchange.engine.memory.residuals
    flat = lambda ts: np.concatenate([t.detach().reshape(-1).numpy() for t in ts])  # noqa: E731
    return {
        "moved": flat(s - a for s, a in zip(start, anchors, strict=True)),
        "meant": flat(meant),
        "residual": flat(residuals[n] for n in names),
    }


def _build(model: nn.Module, **settings) -> thinwire.DiLoCo:
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    return thinwire.DiLoCo(inner, model, "topk", density=0.3, **settings)


def _resume(rank: int, world: int, stop: int, steps: int, settings: dict) -> dict:
    """Train ``steps`` steps straight, and again stopping after ``stop`` (a checkpoint of the
    model per rank and of DiLoCo) and resuming in fresh objects."""
    model = _model(batch_norm=True)
    opt = _build(model, **settings)
    for step in range(steps):
        _train_step(model, opt, rank, step)
    straight = _flat(model)
    opt.close()

    model = _model(batch_norm=True)
    opt = _build(model, **settings)
    for step in range(stop):
        _train_step(model, opt, rank, step)
    saved = copy.deepcopy({"model": model.state_dict(), "diloco": opt.state_dict()})
    pending = opt.pending
    for step in range(stop, steps):  # the first run goes on after saving: no change
        _train_step(model, opt, rank, step)
    went_on = _flat(model)
    opt.close()

    model = _model(batch_norm=True)
    opt = _build(model, **settings)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["diloco"])
    for step in range(stop, steps):
        _train_step(model, opt, rank, step)
    opt.close()
    return {"straight": straight, "went_on": went_on, "resumed": _flat(model), "pending": pending}


def _fragments(rank: int, world: int) -> dict:
    model = _model(batch_norm=True)
    opt = thinwire.LocalSGD(
        torch.optim.SGD(model.parameters(), lr=0.1), model, sync_every=4, fragments=2
    )
    first = {name for name, _ in opt.fragments[0].params}
    spreads = []
    for step in range(4):
        _train_step(model, opt, rank, step)
        per_fragment = []
        for fragment in opt.fragments:
            flat = torch.cat([p.detach().reshape(-1) for _, p in fragment.params]).numpy()
            views = _gathered(flat)
            per_fragment.append(max(float(np.abs(v - views[0]).max()) for v in views))
        spreads.append(per_fragment)
    buffers = _gathered(model[1].running_mean.numpy().copy())
    return {
        "first": sorted(first),
        "offsets": [f.offset for f in opt.fragments],
        "spreads": spreads,
        "buffer_spread": max(float(np.abs(b - buffers[0]).max()) for b in buffers),
    }


def _round_end_order(rank: int, world: int) -> list[tuple[int, str]]:
    """What the round's last step does, in order (overlap on): the buffers' blocking
    average must not queue behind the fragment that starts at that step."""
    model = _model(batch_norm=True)
    opt = thinwire.LocalSGD(
        torch.optim.SGD(model.parameters(), lr=0.1), model, sync_every=4, fragments=2, overlap=1
    )
    calls: list[tuple[int, str]] = []
    average, start = opt._average_buffers, opt._start

    def logged_average() -> None:
        calls.append((opt.inner_steps, "buffers"))
        average()

    def logged_start(index: int, overlap: int) -> None:
        calls.append((opt.inner_steps, f"fragment {index}"))
        start(index, overlap)

    opt._average_buffers, opt._start = logged_average, logged_start  # type: ignore[method-assign]
    for step in range(4):
        _train_step(model, opt, rank, step)
    opt.flush()
    return calls


def _overlap_keeps_progress(rank: int, world: int) -> dict:
    """LocalSGD, overlap 1: the weights after an arrival are the average of the weights
    sent plus this rank's step since."""
    model = _model()
    opt = thinwire.LocalSGD(
        torch.optim.SGD(model.parameters(), lr=0.1), model, sync_every=3, overlap=1
    )
    for step in range(3):
        _train_step(model, opt, rank, step)
    sent = _flat(model)  # the exchange of these weights is under way
    pending = opt.pending
    twin = copy.deepcopy(model)  # this rank's next step alone (plain SGD keeps no state)
    _train_step(twin, torch.optim.SGD(twin.parameters(), lr=0.1), rank, 3)
    _train_step(model, opt, rank, 3)  # the same step; the average arrives after it
    average = np.mean(_gathered(sent), axis=0)
    expected = average + (_flat(twin) - sent)
    after = _flat(model)
    opt.flush()
    views = _gathered(_flat(model))
    return {
        "pending": pending,
        "expected": expected,
        "after": after,
        "flushed_spread": max(float(np.abs(v - views[0]).max()) for v in views),
    }


def _mismatch(rank: int, world: int) -> str:
    model = _model()
    try:
        thinwire.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model, sync_every=4 + rank)
    except RankMismatchError as error:
        return str(error)
    return "no error"


def _foreign_state(rank: int, world: int) -> list[str]:
    model = _model()
    opt = thinwire.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model, sync_every=2)
    other = thinwire.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model, sync_every=3)
    errors = []
    for state in ({"anchors": []}, other.state_dict()):
        try:
            opt.load_state_dict(state)
        except ValueError as error:
            errors.append(str(error))
    return errors


# -- the tests ------------------------------------------------------------------------------


def test_h1_local_sgd_is_synchronous_averaging(pool2) -> None:
    for local, sync in pool2.run(_h1_against_sync):
        np.testing.assert_allclose(local, sync, rtol=1e-5, atol=1e-6)


def test_diloco_is_the_outer_step_on_the_mean_pseudo_gradient(pool2) -> None:
    results = pool2.run(_diloco_against_reference, 9, 3)
    reference = _reference_diloco(2, 9, 3)
    for result in results:
        np.testing.assert_allclose(result["weights"], reference, rtol=1e-5, atol=1e-6)
        assert result["synced"]
        # the ranks agree right after each outer step and differ in between
        assert [s == 0 for s in result["spread"]] == [(i + 1) % 3 == 0 for i in range(9)]


def test_compression_residuals_carry_between_outer_steps(pool2) -> None:
    results = pool2.run(_residuals_carry, True)
    residual = np.mean([r["residual"] for r in results], axis=0)
    meant = np.mean([r["meant"] for r in results], axis=0)
    assert np.abs(residual).max() > 1e-3  # top-k left something out
    for r in results:
        np.testing.assert_allclose(r["moved"] + residual, meant, rtol=1e-4, atol=1e-6)
    dropped = pool2.run(_residuals_carry, False)
    residual = np.mean([r["residual"] for r in dropped], axis=0)
    meant = np.mean([r["meant"] for r in dropped], axis=0)
    assert np.abs(dropped[0]["moved"] + residual - meant).max() > 1e-3


@pytest.mark.parametrize(
    ("stop", "settings"),
    [(5, {"sync_every": 3}), (6, {"sync_every": 4, "fragments": 2, "overlap": 1})],
    ids=["plain", "fragments-overlap"],
)
def test_a_checkpoint_resumes_bit_for_bit(pool2, stop, settings) -> None:
    for result in pool2.run(_resume, stop, 10, settings):
        assert np.array_equal(result["went_on"], result["straight"])
        assert np.array_equal(result["resumed"], result["straight"])
        if settings.get("overlap"):
            assert result["pending"] == 1  # saved with an exchange under way


def test_fragments_synchronise_at_their_own_steps(pool2) -> None:
    results = pool2.run(_fragments)
    for result in results:
        assert result["offsets"] == [2, 0]
        # fragment 0 agrees right after step 2, fragment 1 right after step 4
        assert [[s == 0 for s in step] for step in result["spreads"]] == [
            [False, False],
            [True, False],
            [False, False],
            [False, True],
        ]
        assert result["buffer_spread"] == 0.0  # batch-norm statistics averaged at round end
    assert results[0]["first"] == results[1]["first"]


def test_the_round_averages_buffers_before_its_last_fragment_starts(pool2) -> None:
    for calls in pool2.run(_round_end_order):
        # fragment 0 at step 2; at step 4 the buffers, then fragment 1 (offset 0)
        assert calls[:3] == [(2, "fragment 0"), (4, "buffers"), (4, "fragment 1")]


def test_overlap_adds_the_progress_made_while_the_exchange_ran(pool2) -> None:
    for result in pool2.run(_overlap_keeps_progress):
        assert result["pending"] == 1
        np.testing.assert_allclose(result["after"], result["expected"], rtol=1e-5, atol=1e-6)
        assert result["flushed_spread"] == 0.0


def test_ranks_with_other_settings_are_refused_on_every_rank(pool2) -> None:
    for message in pool2.run(_mismatch):
        assert "sync_every" in message and "range from 4 to 5" in message


def test_a_foreign_state_is_refused(pool2) -> None:
    for errors in pool2.run(_foreign_state):
        assert len(errors) == 2
        assert "not a thinwire.DiLoCo state dict" in errors[0]
        assert "sync_every" in errors[1] and "build it with the saved settings" in errors[1]


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"sync_every": 0}, "sync_every must be an integer >= 1"),
        ({"sync_every": 4, "fragments": 5}, "fragments must be an integer from 1 to"),
        ({"sync_every": 4, "overlap": 4}, "overlap must be an integer >= 0 and below"),
        ({"outer_lr": 0}, "outer_lr must be a number > 0"),
        ({"outer_momentum": 1.0}, "outer_momentum must be a number in [0, 1)"),
    ],
)
def test_bad_settings_say_what_to_use(settings, words) -> None:
    model = _model()
    with pytest.raises(ValueError, match=re.escape(words)):
        thinwire.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model, **settings)


def test_local_sgd_takes_no_outer_settings() -> None:
    model = _model()
    with pytest.raises(TypeError, match=r"use thinwire\.DiLoCo"):
        thinwire.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, outer_lr=0.5)


def test_fragments_are_contiguous_and_about_equal() -> None:
    params = [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate([10, 1, 1, 30, 5, 5])]
    for parts in range(1, 7):
        runs = split_evenly(params, parts)
        assert len(runs) == parts and all(runs)
        assert [name for run in runs for name, _ in run] == [name for name, _ in params]
    sizes = [sum(p.numel() for _, p in run) for run in split_evenly(params, 2)]
    assert sizes == [12, 40]  # the cut before the large parameter
    with pytest.raises(ValueError, match="at most that many fragments"):
        split_evenly(params, 7)


# -- as the dp_method of a hybrid plan -------------------------------------------------------


def _hybrid(rank: int, world: int, method: str, options: dict, directory: str) -> dict:
    """A 2 x 1 x 2 GPT (dp x pp x tp) under ``method``: 4 steps straight; 2 steps, a
    checkpoint, a new trainer resumed from it and 2 more; a save in the middle of a round."""
    from test_parallel_parity import batches, build_model, make_optimizer
    from thinwire.parallel import ParallelPlan, parallelize

    plan = ParallelPlan(dp=2, pp=1, tp=2, microbatches=1, dp_method=method, dp_options=options)

    def trainer():
        return parallelize(build_model("gpt", 4), plan, optimizer=make_optimizer("sgd"))

    def whole(t) -> dict:
        return {k: v.numpy().copy() for k, v in t.full_state_dict().items()}

    straight = trainer()
    losses = [straight.step(b[:, :-1], b[:, 1:]) for b in batches()[:4]]
    expected = whole(straight)
    straight.close()

    first = trainer()
    for b in batches()[:2]:
        first.step(b[:, :-1], b[:, 1:])
    first.save(directory)
    first.step(batches()[2][:, :-1], batches()[2][:, 1:])
    refused = ""
    if options.get("sync_every", 100) > 1:
        try:
            first.save(directory + "-mid")
        except RuntimeError as error:
            refused = str(error)
    first.close()

    resumed = trainer()
    resumed.load(directory)
    for b in batches()[2:4]:
        resumed.step(b[:, :-1], b[:, 1:])
    again = whole(resumed)
    resumed.close()
    return {"losses": losses, "expected": expected, "resumed": again, "refused": refused}


def test_local_sgd_every_step_in_a_hybrid_plan_is_synchronous_sgd(pool4, tmp_path) -> None:
    from test_parallel_parity import batches, build_model, logits_of, make_optimizer
    from thinwire.parallel.loss import token_cross_entropy

    results = pool4.run(_hybrid, "local-sgd", {"sync_every": 1}, str(tmp_path / "ckpt"))
    model = build_model("gpt", 4)  # one process, SGD on the whole batches
    opt = make_optimizer("sgd")(model.parameters())
    losses = []
    for b in batches()[:4]:
        opt.zero_grad()
        loss = token_cross_entropy(logits_of(model(b[:, :-1])), b[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for result in results:
        np.testing.assert_allclose(result["losses"], losses, rtol=1e-4)
        for name, value in model.state_dict().items():
            np.testing.assert_allclose(
                result["expected"][name], value.numpy(), rtol=1e-4, atol=1e-6, err_msg=name
            )
            assert np.array_equal(result["resumed"][name], result["expected"][name]), name


def test_diloco_in_a_hybrid_plan_resumes_bit_for_bit(pool4, tmp_path) -> None:
    options = {"sync_every": 2, "compressor": "topk", "compressor_options": {"density": 0.3}}
    results = pool4.run(_hybrid, "diloco", options, str(tmp_path / "ckpt"))
    for result in results:
        for name, value in result["expected"].items():
            assert np.array_equal(result["resumed"][name], value), name
        assert "taken when a round has ended" in result["refused"]


def test_a_hybrid_plan_checks_diloco_options() -> None:
    from thinwire.parallel import ParallelPlan

    ParallelPlan(dp=2, dp_method="diloco", dp_options={"sync_every": 50, "compressor": "fp16"})
    with pytest.raises(ValueError, match="diloco: sync_every must be an integer >= 1"):
        ParallelPlan(dp=2, dp_method="diloco", dp_options={"sync_every": 0})
    with pytest.raises(ValueError, match=r"method 'local-sgd' has no option.*outer_lr"):
        ParallelPlan(dp=2, dp_method="local-sgd", dp_options={"outer_lr": 0.5})
    with pytest.raises(ValueError, match="applies momentum itself"):
        ParallelPlan(dp=2, dp_method="diloco", dp_options={"compressor": "dgc"})
