"""Bad options, misuse and ranks that disagree or die give a clear error, never a hang."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import thinwire
import thinwire.data_parallel.sparse
from thinwire.launch import init_local_group
from thinwire.tasks.digits import DigitsMLP

pytestmark = [pytest.mark.timeout(120)]


# -- options, checked without any process group -------------------------------------------


def test_unknown_compressor_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown compressor 'dgx'.*none.*topk"):
        thinwire.compressor("dgx")


def test_unknown_option_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"no option\(s\) densty.*density"):
        thinwire.compressor("topk", densty=0.1)


@pytest.mark.parametrize("density", [0, -0.5, 1.5, float("nan"), "0.1"])
def test_density_outside_unit_interval_is_refused(density) -> None:
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
        thinwire.compressor("topk", density=density)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"density": True}, r"density must be in \(0, 1\], got True"),
        ({"masking": "no"}, r"masking must be true or false, got 'no'"),
        ({"masking": 1}, r"masking must be true or false, got 1"),
        ({"weight_decay": float("nan")}, r"weight_decay must be a finite number >= 0, got nan"),
        ({"weight_decay": float("inf")}, r"weight_decay must be a finite number >= 0, got inf"),
        ({"weight_decay": "0.1"}, r"weight_decay must be a finite number >= 0, got '0.1'"),
        ({"momentum": "0.9"}, r"momentum must be a number in \[0, 1\), got '0.9'"),
        ({"momentum": None}, r"momentum must be a number in \[0, 1\), got None"),
        ({"max_norm": float("nan")}, r"max_norm must be a number > 0 or None, got nan"),
    ],
)
def test_dgc_options_of_the_wrong_kind_are_refused_by_name(options: dict, named: str) -> None:
    """Not taken as something else (``"no"`` would switch masking on, NaN weight decay
    would turn every weight into NaN at the first step)."""
    with pytest.raises(ValueError, match=named):
        thinwire.compressor("dgc", **options)


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        lambda params: torch.optim.Adam(params, lr=1e-3),
    ],
    ids=["sgd-momentum", "adam"],
)
def test_dgc_refuses_an_optimizer_with_its_own_momentum(optimizer) -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"dgc applies momentum=0\.9 itself.*SGD\(momentum=0\)"):
        thinwire.DistributedOptimizer(optimizer(model.parameters()), model, "dgc")


def test_register_needs_a_ddp_model() -> None:
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        thinwire.register(nn.Linear(2, 2), "none")


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"fuse_rounds": "no"}, r"fuse_rounds must be True or False, got 'no'"),
        ({"broadcast_parameters": 0}, r"broadcast_parameters must be True or False, got 0"),
        ({"bucket_cap_mb": "25"}, r"bucket_cap_mb must be a number > 0, got '25'"),
    ],
)
def test_wrapper_switches_of_the_wrong_kind_are_refused(options: dict, named: str) -> None:
    """``"no"`` read as true; a string bucket size raised a bare comparison error."""
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=named):
        thinwire.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, **options)


def test_an_optimizer_that_needs_a_closure_is_refused_with_what_to_do() -> None:
    """L-BFGS failed after the first exchange had started, with a bare TypeError."""
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"LBFGS.step\(\) needs a closure.*first-order"):
        thinwire.DistributedOptimizer(torch.optim.LBFGS(model.parameters()), model)


def test_numpy_integers_are_integers() -> None:
    """Counts read from numpy (a config array, a sweep) were refused as not integers."""
    import numpy as np

    assert thinwire.compressor("powersgd", rank=np.int64(2)).rank == 2
    assert thinwire.compressor("dgc", warmup_steps=np.int32(3)).warmup_steps == 3
    with pytest.raises(ValueError, match=r"rank must be an integer >= 1, got 2\.0"):
        thinwire.compressor("powersgd", rank=2.0)


def misuse_register(rank: int, world: int) -> list[str]:
    messages = []
    for attempt in (
        lambda: thinwire.register(DDP(nn.Linear(4, 4)), "topk", memory="none"),
        lambda: thinwire.register(DDP(nn.Linear(4, 4)), "none", optimizer=[1]),
        lambda: thinwire.register(DDP(nn.Linear(4, 4)), "none", fuse_rounds="no"),
    ):
        try:
            attempt()
            messages.append("no error")
        except (TypeError, ValueError) as error:
            messages.append(str(error))
    model = DDP(nn.Linear(4, 4))
    thinwire.register(model, "none")
    try:
        thinwire.register(model, "fp16")
        messages.append("no error")
    except RuntimeError as error:
        messages.append(str(error))
    try:
        model = nn.Sequential(nn.Embedding(8, 2), nn.Linear(2, 2))
        thinwire.data_parallel.sparse.shard_embeddings(DDP(model))
        messages.append("no error")
    except TypeError as error:
        messages.append(str(error))
    from torch.nn.parallel.distributed import _MixedPrecision

    mixed = DDP(nn.Linear(4, 4), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
    try:  # DDP's own hook: the "already has a hook" advice would not help
        thinwire.register(mixed, "none")
        messages.append("no error")
    except RuntimeError as error:
        messages.append(str(error))
    return messages


@pytest.mark.multiprocess
def test_register_misuse_is_refused_when_called(pool2) -> None:
    """Each was accepted and failed later, in backward() or the next forward, with a bare
    cast or attribute error or DDP's own message."""
    for memory, optimizer, fuse, twice, convert, mixed in pool2.run(misuse_register):
        assert "memory must be a thinwire Memory" in memory and "'none'" in memory, memory
        assert "optimizer must be a torch.optim.Optimizer" in optimizer, optimizer
        assert "fuse_rounds must be True or False" in fuse, fuse
        assert "already has a communication hook" in twice, twice
        assert "before wrapping the model in DistributedDataParallel" in convert, convert
        assert "built with mixed_precision=" in mixed, mixed


# -- collective errors, on 2 ranks ----------------------------------------------------------


def mismatched_models(rank: int, world: int, what: str) -> str:
    """Rank 1's model differs from rank 0's in its shapes or its dtype."""
    model = DigitsMLP(hidden=48 if rank == 1 and what == "shapes" else 32)
    if rank == 1 and what == "dtypes":
        model = model.double()
    try:
        thinwire.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    except thinwire.RankMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.parametrize("what", ["shapes", "dtypes"])
def test_mismatched_models_across_ranks(pool2, what: str) -> None:
    """Refused by name; with dtypes it was accepted, and rank 0's fp32 weights broadcast
    into rank 1's fp64 ones were garbage."""
    messages = pool2.run(mismatched_models, what)
    assert "rank 1 has different parameters (names, shapes or dtypes)" in messages[0]
    assert "rank 0 has different parameters (names, shapes or dtypes)" in messages[1]


def requires_grad_changed(rank: int, world: int, front_end: str, change: str) -> str:
    """Build a wrapper, then unfreeze a frozen layer or freeze a trained one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    if change.startswith("unfreeze"):
        model[0].requires_grad_(False)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    given: Any = model.named_parameters() if change.endswith("pairs") else model
    if front_end == "delayed":
        opt: Any = thinwire.DelayedAveraging(sgd, given, delay=1)
    else:
        opt = thinwire.DistributedOptimizer(sgd, given)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    model[0].requires_grad_(change.startswith("unfreeze"))
    model(torch.randn(3, 4)).sum().backward()
    try:
        opt.step()
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.parametrize("front_end", ["sync", "delayed"])
@pytest.mark.parametrize("change", ["unfreeze", "unfreeze-pairs", "freeze"])
def test_requires_grad_changed_after_construction_is_refused(
    pool2, front_end: str, change: str
) -> None:
    """Unfrozen, it was never averaged: the ranks drifted 0.5 apart on it without a word
    (given as (name, parameter) pairs, even after the module form was refused). Frozen,
    it was still stepped with zeros, and momentum moved it."""
    for message in pool2.run(requires_grad_changed, front_end, change):
        verb = "now require" if change.startswith("unfreeze") else "no longer require"
        assert f"0.weight, 0.bias {verb} gradients" in message, message
        assert "Build the wrapper again" in message, message


def load_a_checkpoint(rank: int, world: int, saved_by: str, loaded_by: str) -> str:
    """Train one step with ``saved_by``'s compressor, then load rank 0's checkpoint (or
    this rank's own) into an optimizer with ``loaded_by``'s."""
    torch.manual_seed(0)
    model = DigitsMLP(hidden=32)
    compressors = {"topk": {"density": 0.1}, "powersgd": {"rank": 1}, "powersgd4": {"rank": 4}}

    def build(which: str) -> thinwire.DistributedOptimizer:
        name = which.rstrip("4")
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        return thinwire.DistributedOptimizer(sgd, model, name, **compressors[which])

    first = build(saved_by)
    model(torch.randn(4, 64)).sum().backward()
    first.step()
    state = first.state_dict()
    shared = [state]
    torch.distributed.broadcast_object_list(shared, src=0)  # "everyone loads rank 0's file"
    second = build(loaded_by)
    try:
        second.load_state_dict(state if loaded_by != saved_by else shared[0])
    except ValueError as error:
        return str(error)
    return "loaded"


@pytest.mark.multiprocess
def test_a_checkpoint_is_refused_on_another_rank_or_with_another_compressor(pool2) -> None:
    own_rank, other_rank = pool2.run(load_a_checkpoint, "topk", "topk")
    assert own_rank == "loaded"
    assert "rank 0's of 2, and this is rank 1 of 2" in other_rank
    assert "Save engine.full_state_dict() (every rank's state in one object" in other_rank
    for message in pool2.run(load_a_checkpoint, "powersgd", "powersgd4"):
        assert "saved with compressor PowerSGD(rank=1" in message
        assert "uses PowerSGD(rank=4" in message and "same compressor options" in message


def mismatched_options(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 8))
    try:
        thinwire.register(model, "topk", density=0.1 if rank == 0 else 0.2)
    except thinwire.RankMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
def test_mismatched_compressor_options_across_ranks(pool2) -> None:
    for message in pool2.run(mismatched_options):
        assert "different compressor" in message and "TopK(density=" in message


def gather_only_over_allreduce(rank: int, world: int) -> str:
    model = DDP(nn.Linear(8, 8))
    try:
        thinwire.register(model, "topk", communicator="allreduce", density=0.1)
    except thinwire.IncompatibleCompressorError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
def test_gather_only_compressor_over_allreduce_names_both(pool2) -> None:
    for message in pool2.run(gather_only_over_allreduce):
        assert "'topk'" in message and "'allreduce'" in message and "allgather" in message


# -- a peer that dies mid-run: the survivor gets a clear error within the timeout ----------


def _survivor_or_casualty(rank: int, port: int, fate: str, results: mp.Queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    init_local_group(rank, 2, port, timeout_s=4)
    torch.manual_seed(0)
    model = DigitsMLP(hidden=16)
    opt = thinwire.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, "topk", density=0.1
    )
    for step in range(20):
        if rank == 1 and step == 3:
            if fate == "stalls":
                time.sleep(30)  # alive but silent: only the timeout can tell
            os._exit(0)  # dies without a word, as a killed process would
        model(torch.randn(4, 64)).sum().backward()
        try:
            opt.step()
        except thinwire.CommunicationError as error:
            results.put(("error", step, str(error)))
            return
    results.put(("finished", 20, ""))


def _only_rank_0_registers(rank: int, port: int, results: mp.Queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    init_local_group(rank, 2, port, timeout_s=4)
    model = DDP(nn.Linear(4, 4))
    if rank == 1:
        time.sleep(30)  # builds no wrapper: rank 0 must not wait for it forever
        return
    try:
        thinwire.register(model, "none")
        results.put(("finished", ""))
    except thinwire.CommunicationError as error:
        results.put(("error", str(error)))
    except Exception as error:  # the bare store timeout it used to be
        results.put((type(error).__name__, str(error)))


@pytest.mark.multiprocess
def test_a_wrapper_built_on_one_rank_only_says_what_to_do(first_report: Callable[..., Any]) -> None:
    kind, message = first_report(_only_rank_0_registers)
    assert kind == "error", (kind, message)
    assert "every rank must build the same thinwire wrappers" in message, message


@pytest.mark.multiprocess
@pytest.mark.parametrize("fate", ["dies", "stalls"])
def test_lost_peer_gives_a_communication_error_not_a_hang(
    fate: str, first_report: Callable[..., Any]
) -> None:
    kind, step, message = first_report(_survivor_or_casualty, fate)
    assert kind == "error" and step == 3, (kind, step, message)
    assert "peer rank has probably died" in message
    assert "timeout: 0:00:04" in message  # the error names the group's real timeout
