"""A step refused on the device (``register(..., refusal=...)``): a NaN on one rank leaves
the model, the optimizer and thinwire's state exactly as if the step had never run, with
nothing read back during the step; the host warns later. On the CPU the verdicts are made
lazy (``defer_verdicts``), as they are on a GPU, and a fused optimizer skips the step."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import thinwire
from thinwire.comm.device_refusal import DeviceRefusal
from thinwire.compress import step_buffers
from thinwire.compress.device_undo import where_many
from thinwire.compress.step_buffers import StepBuffers
from thinwire.errors import NonFiniteGradientWarning

pytestmark = [pytest.mark.timeout(120)]

NAN = float("nan")


# -- the pieces, in one process ---------------------------------------------------------------


@pytest.mark.parametrize("refused", [True, False])
def test_where_many_puts_back_only_where_refused(refused: bool) -> None:
    befores = [torch.arange(6.0).view(2, 3), torch.ones(4), torch.arange(3, dtype=torch.float64)]
    afters = [torch.full((2, 3), NAN), torch.full((4,), 7.0)]
    afters.append(torch.full((3,), -1.0, dtype=torch.float64))
    expected = [b.clone() for b in befores] if refused else [a.clone() for a in afters]
    where_many(torch.tensor(refused), befores, afters)
    for got, want in zip(afters, expected, strict=True):
        assert torch.equal(got, want) or (got.isnan().all() and want.isnan().all())


def test_where_many_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="cannot put a"):
        where_many(torch.tensor(True), [torch.zeros(3)], [torch.zeros(4)])


def buffers_with_a_step(poison: bool) -> tuple[StepBuffers, dict[str, tuple[torch.Tensor, ...]]]:
    """Buffers of three keys (two laid out side by side, one alone) after a committed
    step, then a second step that writes NaN (``poison``) or 5s."""
    buffers = StepBuffers(2)
    likes = [torch.zeros(2, 3), torch.zeros(4)]
    for step in range(2):
        buffers.arrange(["a", "b"], likes)  # as the memories do at every step
        assert buffers.begin_flat(["a", "b"], likes) is not None
        buffers.begin("c", torch.zeros(5))
        for key in "abc":
            for tensor in buffers.current(key):
                tensor.fill_(NAN if poison and step == 1 else float(step + 1))
        if step == 0:
            buffers.commit()
            kept = {key: tuple(t.clone() for t in buffers.kept[key]) for key in "abc"}
    return buffers, kept


@pytest.mark.parametrize("refused", [True, False])
def test_step_buffers_commit_unless_keeps_the_committed_state_where_refused(
    refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    buffers, before = buffers_with_a_step(poison=refused)
    alone: list[int] = []  # what goes through where_many: not the block's keys
    monkeypatch.setattr(
        step_buffers,
        "where_many",
        lambda flag, bs, afters: (alone.append(len(afters)), where_many(flag, bs, afters)),
    )
    buffers.commit_unless(torch.tensor(refused))
    assert alone == [2]  # c's two tensors; a and b took one where per block
    for key in "abc":
        for got, then in zip(buffers.kept[key], before[key], strict=True):
            assert torch.equal(got, then if refused else torch.full_like(then, 2.0)), key
    likes = [torch.zeros(2, 3), torch.zeros(4)]
    buffers.arrange(["a", "b"], likes)
    assert buffers.begin_flat(["a", "b"], likes) is not None  # still side by side


def test_a_refused_step_is_skipped_by_a_fused_optimizer_and_an_earlier_flag_kept() -> None:
    weight = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1, fused=True)
    refusal = DeviceRefusal(optimizer)
    earlier = torch.zeros(())
    optimizer.found_inf = earlier  # as a GradScaler sets it before the step
    refusal.settle(0, [torch.tensor(True)])
    weight.grad = torch.ones(3)
    optimizer.step()
    assert torch.equal(weight.detach(), torch.ones(3))
    assert optimizer.found_inf is earlier  # put back for the GradScaler to delete
    del optimizer.found_inf
    flag = refusal.settle(1, [torch.tensor(False), torch.tensor(0, dtype=torch.uint8)])
    assert flag.dtype == torch.bool  # a gathered payload's flag is uint8
    optimizer.step()
    assert torch.allclose(weight.detach(), torch.full((3,), 0.9))
    assert not hasattr(optimizer, "found_inf")
    with pytest.warns(NonFiniteGradientWarning, match="step 0 was skipped on every rank"):
        refusal.poll()
    assert refusal.refused_steps == [0]


def test_a_plain_optimizer_cannot_refuse_on_the_device() -> None:
    with pytest.raises(ValueError, match="fused=True"):
        DeviceRefusal(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))


# -- end to end, on 2 ranks -------------------------------------------------------------------

CASES = {
    "none": ("none", {}),
    "topk": ("topk", {"density": 0.25}),
    "dgc": ("dgc", {"density": 0.25, "warmup_steps": 0}),
    "powersgd": ("powersgd", {"rank": 1}),
    "onebit": ("onebit", {}),
}
BAD_STEP = 3


def train(rank: int, world: int, case: str, refusal: str, skip: bool, bad: int) -> dict[str, Any]:
    """Six steps of a small DDP model; rank 1's batch at step ``bad`` holds a NaN, or
    (``skip``) that step is not trained at all (the reference). Verdicts lazy, as on a GPU."""
    compressor, options = CASES[case]
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    if compressor == "dgc":  # DGC applies the momentum itself
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05, fused=True)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    engine = thinwire.register(model, compressor, optimizer=optimizer, refusal=refusal, **options)
    engine.defer_verdicts = True
    outcome = six_steps(model, optimizer, rank, skip, bad)
    outcome["refused"] = engine.device_refusal.refused_steps if engine.device_refusal else None
    outcome["params"] = [p.detach().clone() for p in model.parameters()]
    outcome["optimizer"] = optimizer.state_dict()["state"]
    outcome["memory"] = engine.memory.state_dict()
    outcome["compressor"] = engine.compressor.state_dict() if compressor == "powersgd" else {}
    return outcome


def six_steps(model: nn.Module, optimizer: Any, rank: int, skip: bool, bad: int) -> dict:
    """Six steps on rank ``rank``'s batches; at step ``bad`` rank 1's holds a NaN, or
    (``skip``) no rank trains on it. Returns the first error and the warnings."""
    data = torch.Generator().manual_seed(rank)
    outcome: dict[str, Any] = {"error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            x = torch.randn(4, 8, generator=data)
            if step == bad:
                if skip:
                    continue
                if rank == 1:
                    x[0, 0] = NAN
            optimizer.zero_grad()
            try:
                model(x).square().mean().backward()
                optimizer.step()
            except Exception as error:
                outcome["error"] = f"{type(error).__name__}: {error}"
                break
    outcome["warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, NonFiniteGradientWarning)
    ]
    return outcome


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested dicts, lists and tensors."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_step_refused_on_the_device_leaves_no_trace(pool2, case: str) -> None:
    refused = pool2.run(train, case, "device", False, BAD_STEP, timeout=90)
    skipped = pool2.run(train, case, "device", True, BAD_STEP, timeout=90)
    for rank in range(2):
        assert refused[rank]["error"] is None, refused[rank]["error"]
        assert refused[rank]["refused"] == [BAD_STEP]
        assert len(refused[rank]["warnings"]) == 1
        assert f"step {BAD_STEP} was skipped" in refused[rank]["warnings"][0]
        for part in ("params", "optimizer", "memory", "compressor"):
            assert same(refused[rank][part], skipped[rank][part]), (rank, part)
        assert all(bool(p.isfinite().all()) for p in refused[rank]["params"])
        assert skipped[rank]["refused"] == [] and not skipped[rank]["warnings"]


@pytest.mark.multiprocess
def test_the_first_step_and_refusal_host_raise_at_the_step(pool2) -> None:
    first = pool2.run(train, "topk", "device", False, 0, timeout=90)
    host = pool2.run(train, "topk", "host", False, BAD_STEP, timeout=90)
    for outcome in (*first, *host):
        assert outcome["error"] is not None and "NonFiniteGradientError" in outcome["error"]
        assert not outcome["warnings"]
    assert host[0]["refused"] is None


def misuse(rank: int, world: int) -> list[str]:
    """``register`` with refusal choices that cannot be met."""
    messages = []
    for optimizer_kind, compressor, refusal in [
        (None, "topk", "device"),
        ("plain", "topk", "device"),
        ("fused", "powersgd-oneround", "device"),
        ("fused", "topk", "sometimes"),
    ]:
        model = DDP(nn.Linear(4, 4))
        optimizer = None
        if optimizer_kind is not None:
            fused = optimizer_kind == "fused"
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
        try:
            thinwire.register(model, compressor, optimizer=optimizer, refusal=refusal)
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


@pytest.mark.multiprocess
def test_register_refuses_a_device_refusal_it_cannot_give(pool2) -> None:
    no_optimizer, plain, oneround, unknown = pool2.run(misuse, timeout=60)[0]
    assert "fused=True" in no_optimizer and "refusal='host'" in no_optimizer
    assert "fused=True" in plain
    assert "powersgd-oneround cannot undo a step on the device" in oneround
    assert "refusal must be one of auto, device, host" in unknown


def train_wrapped(rank: int, world: int, skip: bool) -> dict[str, Any]:
    """:func:`train` through ``DistributedOptimizer(refusal="device")`` with top-k."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    inner = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    optimizer = thinwire.DistributedOptimizer(inner, model, "topk", density=0.25, refusal="device")
    optimizer.engine.defer_verdicts = True
    outcome = six_steps(model, optimizer, rank, skip, BAD_STEP)
    outcome["params"] = [p.detach().clone() for p in model.parameters()]
    outcome["optimizer"] = inner.state_dict()["state"]
    outcome["memory"] = optimizer.engine.memory.state_dict()
    return outcome


@pytest.mark.multiprocess
def test_the_optimizer_wrapper_refuses_on_the_device_too(pool2) -> None:
    refused = pool2.run(train_wrapped, False, timeout=90)
    skipped = pool2.run(train_wrapped, True, timeout=90)
    for rank in range(2):
        assert refused[rank]["error"] is None, refused[rank]["error"]
        assert len(refused[rank]["warnings"]) == 1 and not skipped[rank]["warnings"]
        for part in ("params", "optimizer", "memory"):
            assert same(refused[rank][part], skipped[rank][part]), (rank, part)


def test_the_optimizer_wrapper_refuses_an_unknown_refusal() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="refusal must be one of auto, device, host"):
        thinwire.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, refusal="never",
            broadcast_parameters=False,
        )  # fmt: skip
