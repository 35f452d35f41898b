"""The registry of training strategies: one place decides what a method name means, and a
strategy added as one module (here, one class in this test) works everywhere by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from thinwire.bench.methods import parse_methods
from thinwire.cli import main
from thinwire.compress.registry import compressors
from thinwire.plan import measure_method
from thinwire.strategies import (
    Strategy,
    Wrapped,
    register_strategy,
    strategies,
    strategy,
    unregister_strategy,
)
from thinwire.strategies.base import COSTINGS, SCHEDULES

BUILT_IN = (
    "local", "dense", "ddp-fp16", "ddp-powersgd", "dga", "ps-sync", "ps-async",
    "emb-allgather", "emb-sharded", "local-sgd", "diloco",
)  # fmt: skip


def test_every_name_is_a_strategy_with_valid_defaults() -> None:
    names = list(strategies())
    assert set(BUILT_IN) | set(compressors()) == set(names)
    for name in names:
        chosen = strategy(name)
        assert chosen.name == name and chosen.summary and chosen.__doc__
        assert chosen.costing in COSTINGS and chosen.schedule in SCHEDULES
        assert chosen.options() == chosen.options(chosen.options())  # defaults are valid


def test_the_flags_say_how_each_strategy_runs() -> None:
    assert not strategy("dga").synchronised and not strategy("ps-async").synchronised
    assert strategy("ps-sync").synchronised and strategy("dgc").synchronised
    assert [n for n in strategies() if strategy(n).embedding] == ["emb-allgather", "emb-sharded"]
    assert strategy("dga").schedule == "dga" and strategy("ps-async").schedule == "ps-async"
    for name in ("local-sgd", "diloco"):
        assert strategy(name).schedule == "local" and not strategy(name).synchronised


def test_round_strategies_check_their_settings() -> None:
    with pytest.raises(ValueError, match="diloco: sync_every must be an integer >= 1"):
        strategy("diloco").options({"sync_every": 0})
    with pytest.raises(ValueError, match="local-sgd: overlap must be an integer >= 0 and below"):
        strategy("local-sgd").options({"sync_every": 4, "overlap": 4})
    with pytest.raises(ValueError, match="applies momentum itself, which is for gradients"):
        strategy("diloco").options({"compressor": "dgc"})
    with pytest.raises(ValueError, match=r"has no option.*outer_lr"):
        strategy("local-sgd").options({"outer_lr": 0.5})
    assert strategy("diloco").options()["outer_momentum"] == 0.9


def test_carrying_strategies_check_their_compressor() -> None:
    with pytest.raises(ValueError, match="unknown compressor 'zip'"):
        strategy("dga").options({"compressor": "zip"})
    with pytest.raises(ValueError, match=r"lanes=2 .* carries state"):
        strategy("dga").options({"compressor": "powersgd", "lanes": 2})
    with pytest.raises(ValueError, match="applies momentum itself"):
        strategy("emb-sharded").options({"compressor": "dgc"})
    with pytest.raises(ValueError, match="momentum must be in"):
        strategy("ps-async").options({"momentum": 1.5})
    opts = strategy("ps-sync").options({"compressor": "powersgd"})
    assert opts["compressor_options"] == {"rank": 2}  # the compressor's recorded defaults


class Halved(Strategy):
    """A test strategy: DDP's all-reduce, after halving the learning rate."""

    name = "test-halved"
    summary = "dense, at half the learning rate"
    costing = "dense"
    defaults: ClassVar[Mapping[str, Any]] = {"factor": 0.5}

    def check(self, options, given):  # type: ignore[no-untyped-def]
        if not 0 < options["factor"] <= 1:
            raise ValueError(f"{self.name}: factor must be in (0, 1], got {options['factor']}")

    def wrap(self, model, optimizer, options, setup):  # type: ignore[no-untyped-def]
        for group in optimizer.param_groups:
            group["lr"] *= options["factor"]
        return Wrapped(setup.ddp(model), optimizer)


@pytest.fixture
def halved():  # type: ignore[no-untyped-def]
    register_strategy(Halved)
    yield strategy("test-halved")
    unregister_strategy("test-halved")


def test_a_strategy_in_one_module_works_by_name(halved, capsys) -> None:
    (method,) = parse_methods("test-halved", {"test-halved": {"factor": 0.25}})
    assert method.strategy is halved and method.options == {"factor": 0.25}
    with pytest.raises(ValueError, match="factor must be in"):
        parse_methods("test-halved", {"test-halved": {"factor": 2}})
    params = [("w", torch.zeros(64, 64)), ("b", torch.zeros(64))]
    ours = measure_method("test-halved", params, world_size=4, repeats=1)
    dense = measure_method("dense", params, world_size=4, repeats=1)
    assert [b.collectives for b in ours.buckets] == [b.collectives for b in dense.buckets]
    assert main(["strategies"]) == 0
    assert "test-halved" in capsys.readouterr().out
    model = nn.Linear(2, 2)
    assert halved.prepare(model, method.options) is model


def test_registering_a_taken_name_or_an_unknown_costing_is_refused() -> None:
    class Clash(Halved):
        name = "dense"

    class Odd(Halved):
        name = "test-odd"
        costing = "teleport"

    with pytest.raises(ValueError, match="already taken"):
        register_strategy(Clash)
    with pytest.raises(ValueError, match="costing must be one of"):
        register_strategy(Odd)
