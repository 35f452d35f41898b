"""Bad or odd gradients fail every rank clearly or train on; a refused step leaves no trace."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import thinwire
from thinwire.comm.engine import GradientExchange, GradientItem

pytestmark = [pytest.mark.timeout(120)]


# -- collective errors, on 2 ranks ----------------------------------------------------------


def nan_on_one_rank(rank: int, world: int, compressor: str, options: dict, lazy: bool) -> str:
    """Rank 1 feeds a NaN; every rank must raise NonFiniteGradientError from backward.
    ``lazy``: the verdicts travel as flags read once at the step's end (as on a GPU)."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    engine = thinwire.register(model, compressor, **options)
    engine.defer_verdicts = lazy
    x = torch.randn(4, 8)
    if rank == 1:
        x[0, 0] = float("nan")
    try:
        model(x).sum().backward()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("compressor", "options"),
    [
        ("none", {}),  # read once: no check of its own, the checked sum shows it
        ("none", {"communicator": "allgather"}),  # gathers check only the poison
        ("bf16", {}),
        ("topk", {"density": 0.1}),
        ("randomk", {"density": 0.01}),  # the NaN entries are probably not even sampled
        ("terngrad", {}),  # a max round first
        ("powersgd", {"rank": 1}),  # two sum rounds
        ("powersgd", {"rank": 1, "communicator": "direct"}),  # sums of an all-to-all
    ],
)
@pytest.mark.parametrize("lazy", [False, True], ids=["read-each-round", "read-once"])
def test_nan_gradient_on_one_rank_fails_every_rank(
    pool2, compressor: str, options: dict, lazy: bool
) -> None:
    messages = pool2.run(nan_on_one_rank, compressor, options, lazy, timeout=60)
    assert "non-finite gradient" in messages[0] and "another rank" in messages[0], messages[0]
    assert "non-finite gradient" in messages[1] and "on this rank (1)" in messages[1], messages[1]


def integer_gradient(rank: int, world: int) -> str:
    engine = GradientExchange("none")
    try:
        engine.exchange([GradientItem("counts", torch.ones(3, dtype=torch.int64))])
    except TypeError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
def test_non_floating_gradient_is_refused(pool2) -> None:
    for message in pool2.run(integer_gradient):
        assert "'counts'" in message and "torch.int64" in message and "floating" in message


def sparse_gradient(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = nn.Embedding(10, 4, sparse=True)
    opt = thinwire.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    model(torch.tensor([1, 2])).sum().backward()
    try:
        opt.step()
    except TypeError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
def test_a_sparse_gradient_is_refused_with_what_to_do(pool2) -> None:
    """It failed inside torch ("reshape is not implemented for sparse tensors")."""
    for message in pool2.run(sparse_gradient):
        assert "the gradient of 'weight' is sparse" in message
        assert "sparse=False" in message and "thinwire.data_parallel.sparse" in message


def fp16_overflow(rank: int, world: int) -> str:
    model = nn.Linear(4, 1)
    opt = thinwire.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, "fp16")
    (model(torch.ones(2, 4)).sum() * 1e6).backward()
    try:
        opt.step()
    except thinwire.NonFiniteGradientError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
def test_an_fp16_overflow_names_fp16_as_a_cause(pool2) -> None:
    """Every rank's gradients were finite; their fp16 payloads were not."""
    for message in pool2.run(fp16_overflow):
        assert "fp16 holds magnitudes up to 65504" in message and "use bf16" in message


class WithEmptyParameters(nn.Module):
    """A linear layer beside parameters with no entries (a 0-row matrix, an empty bias),
    as pruned or configurable models end up with."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.no_rows = nn.Parameter(torch.zeros(0, 5))
        self.no_entries = nn.Parameter(torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).sum() + self.no_rows.sum() + self.no_entries.sum()


def train_with_empty_parameters(rank: int, world: int, name: str) -> list[float]:
    torch.manual_seed(rank)
    model = WithEmptyParameters()
    opt = thinwire.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, name)
    for _ in range(2):
        model(torch.randn(3, 8)).backward()
        opt.step()
        opt.zero_grad()
    return model.linear.weight.detach().flatten().tolist()


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(thinwire.compressors()))
def test_every_compressor_trains_beside_empty_parameters(pool2, name: str) -> None:
    """top-k asked for one of zero entries and crashed ("selected index k out of range")."""
    first, second = pool2.run(train_with_empty_parameters, name)
    assert first == second  # and the ranks agree on what they did train


def frozen_after_ddp_was_built(rank: int, world: int) -> list[float]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model = DDP(net, find_unused_parameters=True)
    net[0].weight.requires_grad_(False)  # DDP's buckets still hold it
    thinwire.register(model, "none")
    model(torch.randn(3, 4) + rank).sum().backward()
    assert net[0].weight.grad is None
    return net[1].weight.grad.flatten().tolist()


@pytest.mark.multiprocess
def test_a_parameter_frozen_after_ddp_was_built_is_left_alone(pool2) -> None:
    """The hook looked parameters up among those that required gradients at register()
    and crashed with a bare KeyError on the frozen one."""
    first, second = pool2.run(frozen_after_ddp_was_built)
    assert first == second


def train_on_after_a_nan_step(rank: int, world: int, name: str, front: str) -> list[Any]:
    """Step 1: rank 1's gradient has a NaN; every rank raises and skips the step (as a
    loss scaler would). Steps 2-4 are finite and must train normally."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    sgd = torch.optim.SGD(net.parameters(), lr=0.05)
    if front == "hook":
        model: nn.Module = DDP(net)
        thinwire.register(model, name)
        opt: Any = sgd
    else:
        model, opt = net, thinwire.DistributedOptimizer(sgd, net, name)
    events, counts = [], []
    engine = opt.engine if front == "optimizer" else None
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        if step == 0 and rank == 1:
            x[0, 0] = float("nan")
        opt.zero_grad()
        try:
            model(x).square().mean().backward()
            opt.step()
            events.append("stepped")
            if engine is not None:
                stats = engine.last_step
                counts.append((stats.dense_bytes, stats.collectives, stats.tensors))
        except thinwire.NonFiniteGradientError:
            events.append("refused")
        except RuntimeError as error:  # the DDP hook's error reaches backward() re-wrapped
            events.append("refused" if "non-finite gradient" in str(error) else str(error))
    weights = torch.cat([p.detach().flatten() for p in net.parameters()])
    return [events, bool(torch.isfinite(weights).all()), weights.tolist(), counts]


@pytest.mark.multiprocess
@pytest.mark.parametrize("front", ["optimizer", "hook"])
@pytest.mark.parametrize("name", sorted(thinwire.compressors()))
def test_training_goes_on_after_a_refused_nan_step(pool2, name: str, front: str) -> None:
    """The NaN used to stay in the error-feedback memory: the next steps applied NaN
    weights without an error (top-k, DGC, 1-bit, signSGD) or raised forever (PowerSGD)."""
    first, second = pool2.run(train_on_after_a_nan_step, name, front)
    for events, finite, _, counts in (first, second):
        assert events == ["refused", "stepped", "stepped", "stepped"], events
        assert finite
        # the refused step's counts do not add to the next step's statistics
        assert len(set(counts)) <= 1, counts
    assert first[2] == second[2]  # the ranks agree


def train_with_or_without_a_refused_step(
    rank: int, world: int, name: str, front: str, layer: int, refuse: bool, lazy: bool = False
) -> list[float]:
    """Four steps of data; with ``refuse``, step 1 runs with a NaN in rank 1's gradient of
    ``layer`` and is refused, else step 1 is left out. Either way the same three steps are
    taken. ``lazy``: verdicts read once per step (as on a GPU)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    sgd = torch.optim.SGD(net.parameters(), lr=0.05)
    if front == "hook":  # several buckets: the later layers' are exchanged first
        model: nn.Module = DDP(net, bucket_cap_mb=0.01)
        engine = thinwire.register(model, name)
        opt: Any = sgd
    else:
        model, opt = net, thinwire.DistributedOptimizer(sgd, net, name, bucket_cap_mb=0.01)
        engine = opt.engine
    engine.defer_verdicts = lazy
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        if step == 1 and not refuse:
            continue
        poison = None
        if step == 1 and rank == 1:  # the rest of the gradient is finite
            poison = net[layer].weight.register_hook(lambda grad: grad * float("nan"))
        opt.zero_grad()
        try:
            model(x).square().mean().backward()
            opt.step()
        except (thinwire.NonFiniteGradientError, RuntimeError) as error:
            assert step == 1 and "non-finite gradient" in str(error), error
        finally:
            if poison is not None:
                poison.remove()
    return torch.cat([p.detach().flatten() for p in net.parameters()]).tolist()


@pytest.mark.multiprocess
@pytest.mark.parametrize("layer", [0, 4], ids=["last-bucket", "first-bucket"])
@pytest.mark.parametrize("front", ["optimizer", "hook"])
@pytest.mark.parametrize("name", ["topk", "dgc", "powersgd", "onebit", "terngrad"])
def test_a_refused_step_leaves_no_trace(pool2, name: str, front: str, layer: int) -> None:
    """The finite gradients of a refused step stayed in the error-feedback memory and were
    sent with the next step's, what the step's earlier buckets had sent was gone from the
    memory though never applied, the buckets after the refused one were exchanged and
    kept, and the compressor's warm starts and random streams had moved on. Now training
    on after a refused step is training without it, bit for bit."""
    refused = pool2.run(train_with_or_without_a_refused_step, name, front, layer, True)
    skipped = pool2.run(train_with_or_without_a_refused_step, name, front, layer, False)
    assert refused[0] == skipped[0] and refused[1] == skipped[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("front", ["optimizer", "hook"])
@pytest.mark.parametrize("name", ["none", "dgc", "powersgd", "onebit"])
def test_a_step_refused_at_its_end_leaves_no_trace(pool2, name: str, front: str) -> None:
    """With the verdicts read once per step (a GPU's way: no host wait per bucket), the
    poisoned first bucket is exchanged, its results handed on and kept in the memory until
    the step's last bucket reads the verdict; then all of it is undone, bit for bit."""
    args = (name, front, 4)
    refused = pool2.run(train_with_or_without_a_refused_step, *args, True, True)
    skipped = pool2.run(train_with_or_without_a_refused_step, *args, False, True)
    eager = pool2.run(train_with_or_without_a_refused_step, *args, False, False)
    assert refused[0] == skipped[0] and refused[1] == skipped[1]
    assert skipped == eager  # the same training when every step is finite


def nan_in_the_last_bucket(rank: int, world: int, lazy: bool) -> str:
    """Rank 1's first layer (DDP's last bucket) gets a NaN gradient while the earlier
    bucket's PowerSGD Q round is still in flight, to be fused with it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    model = DDP(net, bucket_cap_mb=0.01)  # several buckets
    engine = thinwire.register(model, "powersgd", rank=1)
    engine.defer_verdicts = lazy
    if rank == 1:
        net[0].weight.register_hook(lambda grad: grad * float("nan"))
    try:
        model(torch.randn(4, 8)).sum().backward()
    except Exception as error:
        return f"{type(error).__name__}: {error} (in flight after: {engine.in_flight})"
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.parametrize("lazy", [False, True], ids=["read-each-round", "read-once"])
def test_nan_in_a_later_bucket_with_fused_rounds_fails_every_rank(pool2, lazy: bool) -> None:
    messages = pool2.run(nan_in_the_last_bucket, lazy, timeout=60)
    assert "non-finite gradient" in messages[0] and "another rank" in messages[0], messages[0]
    assert "on this rank (1) in 0.weight" in messages[1], messages[1]
    assert all("in flight after: 0" in m for m in messages), messages
    # DDP re-raises it from backward() as a RuntimeError that names thinwire's error (it
    # said "Unable to cast ... to Tensor" around it)
    for message in messages:
        assert message.startswith("RuntimeError: Got the following error"), message
        assert "NonFiniteGradientError: non-finite gradient" in message, message
        assert "Unable to cast" not in message, message


def sums_per_exchange(rank: int, world: int, compressor: str) -> int:
    """How many finiteness sums one DDP step's exchange takes on the CPU (read each round)."""
    import thinwire.comm.collectives as collectives_module
    import thinwire.compress.finite as finite_module

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    engine = thinwire.register(model, compressor)
    engine.defer_verdicts = False
    model(torch.randn(4, 8)).sum().backward()  # the first step: DDP lays its buckets out
    calls = []
    real = finite_module.all_finite

    def counted(tensor: torch.Tensor) -> bool:
        calls.append(tensor.numel())
        return real(tensor)

    finite_module.all_finite = collectives_module.all_finite = counted
    try:
        model(torch.randn(4, 8)).sum().backward()
    finally:
        finite_module.all_finite = collectives_module.all_finite = real
    return len(calls)


@pytest.mark.multiprocess
def test_a_sum_that_shows_a_nan_itself_is_the_only_check(pool2) -> None:
    """``none``'s all-reduced sum shows any rank's NaN: one sum a step checks it (the input
    is checked only to name a tensor once the sum was not finite); top-k's gather does
    not show it, so its input is checked too."""
    assert pool2.run(sums_per_exchange, "none") == [1, 1]
    assert all(n >= 2 for n in pool2.run(sums_per_exchange, "topk"))
