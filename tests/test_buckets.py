"""Tapered DDP buckets: the plan, DDP reproducing it, and the options that ask for it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from thinwire.data_parallel import buckets
from thinwire.data_parallel.buckets import (
    MB,
    TAPERED,
    assign_buckets,
    bucket_limits_mb,
    ddp_bucket_options,
    parse_bucket_spec,
    takes_bucket_lists,
    tapered_buckets,
    tapered_limits,
)
from thinwire.launch import run_local
from thinwire.plan.profile import bucket_groups


def _model() -> nn.Module:
    """Layers that grow towards the output, as a CNN's do (the tail is the small end)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Linear(16, 64), nn.Linear(64, 256), nn.Linear(256, 512)
    )


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4 * MB), min_size=1, max_size=60),
    tail=st.floats(0.01, 2.0),
    factor=st.floats(1.5, 8.0),
    cap=st.floats(2.0, 30.0),
)
def test_ddp_filling_with_the_planned_limits_reproduces_the_taper(
    sizes: list[int], tail: float, factor: float, cap: float
) -> None:
    limits = tapered_limits(sizes, cap_mb=cap, tail_mb=tail, factor=factor)
    groups = assign_buckets(sizes, limits)
    filled = [sum(sizes[i] for i in group) for group in groups]
    assert filled == limits  # DDP's own filling gives exactly the planned buckets
    assert [i for group in groups for i in group] == list(range(len(sizes)))
    # counted from the end of the backward pass, bucket k holds at least its target and
    # would not without the tensor that closed it; the front one, what is left, holds at
    # least the target of the bucket after it (or it would have joined that bucket)
    targets = [tail * MB]
    for k, group in enumerate(reversed(groups)):
        held = sum(sizes[i] for i in group)
        if k < len(groups) - 1:
            assert targets[k] <= held < targets[k] + sizes[group[0]]
        elif k > 0:
            assert held >= targets[k - 1]
        targets.append(min(targets[k] * factor, cap * MB))


def test_the_taper_ends_in_small_buckets_and_refuses_what_it_cannot_plan() -> None:
    model = _model()
    caps = tapered_buckets(model, tail_mb=0.0005, factor=4.0)
    sizes = [p.numel() * 4 for p in reversed(list(model.parameters()))]
    assert sum(caps) == pytest.approx(sum(sizes) / MB)
    assert caps == sorted(caps, reverse=True) and len(caps) >= 3
    # the last bucket is the first layer (576 bytes of weight and bias: past 0.0005 MB)
    assert caps[-1] == pytest.approx((8 * 16 + 16) * 4 / MB)
    for options, message in [
        ({"tail_mb": 0}, r"tail_mb must be a number in \(0, cap_mb=25.0\], got 0"),
        ({"tail_mb": 30.0}, r"tail_mb must be a number in \(0, cap_mb=25.0\]"),
        ({"factor": 1.0}, r"factor must be a number > 1"),
        ({"cap_mb": "25"}, r"cap_mb must be a number > 0, got '25'"),
    ]:
        with pytest.raises(ValueError, match=message):
            tapered_buckets(model, **options)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters that require gradients"):
        tapered_buckets(frozen)


def test_bucket_specs_are_parsed_and_refused_with_what_to_give() -> None:
    assert parse_bucket_spec("tapered") == TAPERED and parse_bucket_spec(" Tapered ") == TAPERED
    assert parse_bucket_spec("2") == 2.0
    for text in ["0", "-1", "nan", "small"]:
        with pytest.raises(ValueError, match="--bucket-cap-mb must be a size in MB"):
            parse_bucket_spec(text)
    assert bucket_limits_mb(None, [MB]) == [1.0, 25.0]  # DDP's own
    assert bucket_limits_mb(2, [MB]) == [2.0]
    with pytest.raises(ValueError, match="bucket_cap_mb must be a size in MB > 0 or 'tapered'"):
        ddp_bucket_options("taper", _model())


def test_a_taper_can_be_chosen_in_the_spec() -> None:
    model = _model()
    sizes = [p.numel() * p.element_size() for p in reversed(list(model.parameters()))]
    assert parse_bucket_spec("Tapered:0.001:2") == "tapered:0.001:2"
    chosen = tapered_buckets(model, tail_mb=0.001, factor=2.0)
    assert chosen != tapered_buckets(model)  # the model is large enough to tell them apart
    assert ddp_bucket_options("tapered:0.001:2", model) == {"bucket_cap_mb_list": chosen}
    assert bucket_limits_mb("tapered:0.001:2", sizes) == pytest.approx(chosen)
    assert bucket_limits_mb("tapered", sizes) == pytest.approx(tapered_buckets(model))
    for text in ["tapered:0.1", "tapered:0:2", "tapered:0.1:1", "tapered:a:b", "tapered:1:2:3"]:
        with pytest.raises(ValueError, match=r"a taper is 'tapered' or 'tapered:TAIL:FACTOR'"):
            parse_bucket_spec(text)
    with pytest.raises(ValueError, match=r"e\.g\. 'tapered:0\.2:2'"):
        ddp_bucket_options("tapered:0.1:0.5", model)


def test_tapered_buckets_on_a_torch_without_bucket_lists_say_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(buckets, "takes_bucket_lists", lambda: False)
    with pytest.raises(ValueError, match="upgrade torch, or give a size in MB instead"):
        ddp_bucket_options(TAPERED, _model())
    assert ddp_bucket_options(2.0, _model()) == {"bucket_cap_mb": 2.0}


def test_the_plan_models_the_tapered_layout() -> None:
    model = _model()
    params = [(n, p.detach()) for n, p in model.named_parameters()]
    groups = bucket_groups(params, None, TAPERED)
    sizes = {n: p.numel() * 4 for n, p in params}
    assert [sum(sizes[n] for n in g) / MB for g in groups] == pytest.approx(tapered_buckets(model))
    assert bucket_groups(params, None, None) == bucket_groups(params, None, 25.0)


def _buckets_ddp_builds(rank: int, world_size: int, tail_mb: float) -> list[list[str]]:
    """The buckets (parameter names, reduction order) of a DDP model built with the taper,
    seen by a communication hook after DDP's first-iteration rebuild."""
    from torch.nn.parallel import DistributedDataParallel

    from thinwire.bench.methods import parse_methods, wrap

    model = _model()
    names = {p: n for n, p in model.named_parameters()}
    if tail_mb:
        ddp = DistributedDataParallel(
            model, bucket_cap_mb_list=tapered_buckets(model, tail_mb=tail_mb)
        )
    else:  # what the bench builds for --bucket-cap-mb tapered
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = wrap(parse_methods("dense")[0], model, optimizer, bucket_cap_mb=TAPERED).model
    seen: list[list[str]] = []

    def record(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        seen.append([names[p] for p in bucket.parameters()])
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.register_comm_hook(None, record)
    for _ in range(3):
        seen.clear()
        ddp(torch.randn(4, 8)).sum().backward()
    return seen


@pytest.mark.skipif(not takes_bucket_lists(), reason="this torch's DDP has no bucket_cap_mb_list")
@pytest.mark.timeout(120)
def test_ddp_builds_the_buckets_the_taper_planned() -> None:
    model = _model()
    params = [(n, p.detach()) for n, p in model.named_parameters()]
    ready = [n for n, _ in reversed(params)]
    sizes = [p.numel() * 4 for _, p in reversed(params)]
    expected = [
        [ready[i] for i in group]
        for group in assign_buckets(sizes, tapered_limits(sizes, tail_mb=0.001))
    ]
    for seen in run_local(_buckets_ddp_builds, 2, (0.001,), timeout=100):
        assert seen == expected and len(seen) >= 3
    # the bench's own --bucket-cap-mb tapered (default tail): as planned for this model
    default = bucket_groups(params, None, TAPERED)
    for seen in run_local(_buckets_ddp_builds, 2, (0.0,), timeout=100):
        assert seen == default


def test_bench_and_plan_take_tapered_and_refuse_other_words(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from thinwire.bench.methods import parse_methods
    from thinwire.bench.runner import BenchConfig
    from thinwire.cli import main
    from thinwire.plan.report import parse_request

    for command in ("bench", "plan"):
        for text, message in [
            ("taper", "must be a size in MB, 'tapered' or 'tapered:TAIL:FACTOR', got 'taper'"),
            ("0", "--bucket-cap-mb must be a size in MB > 0 or 'tapered'"),
            ("tapered:0.05", "a taper is 'tapered' or 'tapered:TAIL:FACTOR'"),
        ]:
            with pytest.raises(SystemExit) as exited:
                main([command, "--task", "digits", "--workers", "2", "--bucket-cap-mb", text])
            assert exited.value.code == 2
            assert message in capsys.readouterr().err
    request = parse_request("digits", 2, "10mbit", "1ms", bucket_cap_mb=TAPERED)
    assert request.bucket_cap_mb == TAPERED
    chosen = parse_request("digits", 2, "10mbit", "1ms", bucket_cap_mb="tapered:0.2:2")
    assert chosen.bucket_cap_mb == "tapered:0.2:2"
    config = BenchConfig(task="digits", methods=parse_methods("dense"), bucket_cap_mb=TAPERED)
    assert config.bucket_cap_mb == TAPERED
    with pytest.raises(ValueError, match="bucket_cap_mb must be a size in MB > 0 or 'tapered'"):
        BenchConfig(task="digits", methods=parse_methods("dense"), bucket_cap_mb=0)
