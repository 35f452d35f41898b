"""Profiling for the planner: compute, readiness, each method's traffic, embedding lookups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import thinwire
from thinwire.compress.base import Slot, run_locally
from thinwire.compress.none import NoCompression
from thinwire.plan import (
    ALLGATHER,
    ALLREDUCE,
    DIRECT,
    Link,
    MethodCost,
    ddp_buckets,
    measure_compute,
    measure_method,
    profile_model,
)
from thinwire.plan.embedding import TableLookups, measure_lookups, table_traffic
from thinwire.strategies import strategy

pytestmark = [pytest.mark.timeout(120)]

# -- profiling ------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(256, 512)
        self.second = nn.Linear(512, 512)
        self.last = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.second(torch.relu(self.first(x)))))


def named(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters()]


def test_ddp_buckets_fill_in_ready_order_with_a_small_first_bucket() -> None:
    params = named(Net())  # 0.13 M + 0.26 M + 5 k weights
    buckets = ddp_buckets(params)
    # reverse order: last.bias, last.weight, second.bias, second.weight (>= 1 MiB: closes)
    assert buckets == [
        ["last.bias", "last.weight", "second.bias", "second.weight"],
        ["first.bias", "first.weight"],
    ]
    assert ddp_buckets(params, bucket_cap_mb=0.5, first_bucket_mb=1e-5)[0] == ["last.bias"]
    with pytest.raises(ValueError, match="order must name each of the 6 parameters"):
        ddp_buckets(params, ["last.bias"])


def test_measure_compute_times_phases_and_gradient_readiness() -> None:
    torch.manual_seed(0)
    model = Net()
    batch = (torch.randn(16, 256), torch.randint(0, 10, (16,)))
    profile = measure_compute(model, batch, nn.functional.cross_entropy, repeats=3, warmup=1)
    assert profile.time.forward_s > 0 and profile.time.backward_s > 0
    assert set(profile.ready) == {n for n, _ in named(model)}
    assert all(0.0 <= r <= 1.0 for r in profile.ready.values())
    assert profile.ready["last.weight"] <= profile.ready["first.weight"]
    assert profile.order.index("last.weight") < profile.order.index("first.weight")


def engine_bytes(compressor: thinwire.Compressor, params, world: int, step: int) -> int:
    """What thinwire's engine would contribute per step, tensor by tensor via run_locally."""
    total = 0
    for name, p in params:
        grad = torch.randn(p.shape)
        chosen = compressor if compressor.compresses(grad) else NoCompression()
        wire: list[int] = []
        run_locally(chosen.exchange(grad, Slot(name, step, world)), wire_bytes=wire)
        total += sum(wire)
    return total


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("dgc", {"density": 0.01, "warmup_steps": 5}),
        ("topk", {"density": 0.05}),
        ("onebit", {}),
        ("powersgd", {"rank": 2}),
        ("fp16", {}),
        ("none", {}),
    ],
)
def test_thinwire_traffic_matches_the_engine(method: str, options: dict) -> None:
    params = named(Net())
    cost = measure_method(
        method, params, world_size=4, options=options, repeats=1, fuse_rounds=False
    )
    steady = options.get("warmup_steps", 0)  # past DGC's warm-up
    expected = engine_bytes(thinwire.compressor(method, **options), params, 4, steady)
    gathers = sum(c.kind == ALLGATHER for b in cost.buckets for c in b.collectives)
    assert cost.payload_bytes == expected + gathers  # + one status byte per all-gather
    assert len(cost.buckets) == 2
    assert cost.dense_bytes == sum(p.numel() * 4 for _, p in params)
    kinds = {c.kind for b in cost.buckets for c in b.collectives}
    summable = thinwire.compressor(method).aggregation is thinwire.compress.Aggregation.SUM
    assert kinds == ({ALLREDUCE} if summable else {ALLGATHER})
    rounds = 2 if method == "powersgd" else 1
    if method != "fp16":  # fp16 payloads and fp32 biases: two dtypes, two all-reduces
        assert all(len(b.collectives) == rounds for b in cost.buckets)


def test_traffic_that_alternates_between_steps_is_modelled_at_the_heavier_step() -> None:
    params = named(Net())
    options = {"rank": 2, "alternate": True}
    comp = thinwire.compressor("powersgd-oneround", **options)
    per_step = [engine_bytes(comp, params, 4, step) for step in range(2)]  # P, then Q
    assert per_step[0] != per_step[1]
    modelled = [
        measure_method(
            "powersgd-oneround", params, world_size=4, options=options, repeats=repeats
        ).payload_bytes
        for repeats in (2, 3)
    ]
    assert modelled == [max(per_step)] * 2


def test_fused_rounds_move_a_buckets_second_round_into_the_next_buckets_first() -> None:
    params = named(Net())

    def cost(method: str, options: dict, fuse: bool) -> MethodCost:
        return measure_method(
            method, params, world_size=4, options=options, repeats=1, fuse_rounds=fuse
        )

    alone, fused = (cost("powersgd", {"rank": 2}, fuse) for fuse in (False, True))
    (p0, q0), (p1, q1) = (b.collectives for b in alone.buckets)
    assert [[c.nbytes for c in b.collectives] for b in fused.buckets] == [
        [p0.nbytes],
        [q0.nbytes + p1.nbytes, q1.nbytes],
    ]
    assert fused.payload_bytes == alone.payload_bytes and fused.collectives == 3
    one_round = [cost("dgc", {"density": 0.01}, fuse) for fuse in (False, True)]
    assert [b.collectives for b in one_round[0].buckets] == [
        b.collectives for b in one_round[1].buckets
    ]


def test_communicator_option_picks_the_collectives_and_is_checked() -> None:
    params = named(Net())

    def kinds(method: str, options: dict) -> set[str]:
        cost = measure_method(method, params, world_size=4, options=options, repeats=1)
        return {c.kind for b in cost.buckets for c in b.collectives}

    assert kinds("powersgd", {"rank": 2}) == {ALLREDUCE}
    assert kinds("powersgd", {"rank": 2, "communicator": "direct"}) == {DIRECT}
    assert kinds("dgc", {"density": 0.01, "communicator": "direct"}) == {DIRECT}
    assert kinds("dgc", {"density": 0.01}) == {ALLGATHER}
    with pytest.raises(ValueError, match="communicator must be one of"):
        strategy("powersgd").options({"communicator": "ring"})
    with pytest.raises(ValueError, match="cannot run on communicator 'allreduce'"):
        strategy("dgc").options({"communicator": "allreduce"})


def test_dgc_compresses_large_matrices_about_500x() -> None:
    params = [("w", torch.zeros(1000, 1000))]
    cost = measure_method("dgc", params, world_size=4, options={"density": 0.001}, repeats=1)
    # k = 1000 values + int32 indices = 8000 bytes, + the status byte of the all-gather
    assert cost.payload_bytes == 8001
    assert cost.compression_ratio == pytest.approx(500, rel=0.01)
    assert cost.compress_s > 0


def test_profile_predicts_with_a_measured_compute_time() -> None:
    torch.manual_seed(0)
    model = Net()
    batch = (torch.randn(16, 256), torch.randint(0, 10, (16,)))
    methods = {"local": {}, "dense": {}, "dgc": {"density": 0.01}}
    profile = profile_model(
        model, batch, nn.functional.cross_entropy, methods, world_size=4, repeats=2
    )
    link = Link(10e6, 0.001)
    dense = profile.predict("dense", link)
    assert dense.comm_s == pytest.approx(profile.costs["dense"].comm_time(4, link))
    assert profile.predict("local", link).efficiency == 1.0
    # a measured compute 3x the profiled one: compression slows down by 3x too
    slow = profile.compute.time.scaled(3.0)
    dgc = profile.predict("dgc", link, compute=slow)
    assert dgc.compute_s == pytest.approx(slow.total)
    assert dgc.compress_s == pytest.approx(3 * profile.costs["dgc"].compress_s)
    as_total = profile.predict("dgc", link, compute=slow.total)  # a measured step time
    assert as_total.step_s == pytest.approx(dgc.step_s)
    with pytest.raises(ValueError, match="method 'topk' was not profiled"):
        profile.predict("topk", link)
    # workers whose compute is not on their CPU (sleeps, an accelerator): the compression
    # follows the CPU's own factor, not the compute's
    fast = profile.compute.time.scaled(0.02)
    virtual = profile.predict("dgc", link, compute=fast, cpu_scale=1.5)
    assert virtual.compute_s == pytest.approx(fast.total)
    assert virtual.compress_s == pytest.approx(1.5 * profile.costs["dgc"].compress_s)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="cpu_scale must be a finite factor > 0"):
            profile.predict("dgc", link, cpu_scale=bad)


def test_pytorch_hook_traffic() -> None:
    params = named(Net())
    dense = measure_method("dense", params, world_size=4, repeats=1)
    assert [len(b.collectives) for b in dense.buckets] == [1, 1]
    assert dense.payload_bytes == dense.dense_bytes and dense.compress_s == 0
    half = measure_method("ddp-fp16", params, world_size=4, repeats=1)
    assert half.payload_bytes * 2 == dense.dense_bytes
    low = measure_method("ddp-powersgd", params, world_size=4, options={"rank": 2}, repeats=1)
    # one bucket (as thinwire bench runs the hook on gloo): the 1-D tensors 10 + 512 + 512
    # dense; P: last.weight 10x512 -> 10x2, the 512x512 -> 512x2, first.weight 512x256 ->
    # 512x2; Q: 512x2 + 512x2 + 256x2
    assert len(low.buckets) == 1
    assert [c.nbytes for c in low.buckets[0].collectives] == [
        4 * 1034,
        4 * (20 + 1024 + 1024),
        4 * (1024 + 1024 + 512),
    ]
    assert measure_method("local", params, world_size=4).buckets == ()


def test_method_table() -> None:
    assert strategy("local").costing == "none"
    assert strategy("dense").costing == "dense"
    assert strategy("ddp-powersgd").costing == "torch-powersgd"
    assert strategy("dgc").costing == "thinwire"
    with pytest.raises(ValueError, match="unknown method 'zip'; choose one of: local, dense"):
        strategy("zip")
    assert strategy("ddp-powersgd").options({"rank": 4})["matrix_approximation_rank"] == 4
    with pytest.raises(ValueError, match="method 'dense' has no option"):
        strategy("dense").options({"rank": 4})
    with pytest.raises(ValueError, match="density"):
        strategy("dgc").options({"density": 2.0})
    # the error names the option as the user spelled it
    with pytest.raises(ValueError, match=r"ddp-powersgd: rank must be an integer >= 1, got 0"):
        strategy("ddp-powersgd").options({"rank": 0})
    with pytest.raises(ValueError, match=r"matrix_approximation_rank must be .*, got 2\.5"):
        strategy("ddp-powersgd").options({"matrix_approximation_rank": 2.5})


# -- the embedding methods ---------------------------------------------------------------------


class _Bag(nn.Module):
    """A table of 12 rows x 5 and a head: the smallest model with a lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(12, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(dim=1))


def test_lookups_count_distinct_ids_per_rank_and_per_owner_by_hand() -> None:
    # 2 ranks, owner = id % 2; step 0: rank 0 looks up {0, 1, 2, 3} (ids repeated), rank 1
    # {1, 3, 5}; step 1: rank 0 {4}, rank 1 {0, 2, 4, 6, 8, 10}
    batches = [
        [torch.tensor([[0, 1, 2, 3, 3, 0]]), torch.tensor([[1, 3, 5, 5, 5, 1]])],
        [torch.tensor([[4, 4, 4, 4, 4, 4]]), torch.tensor([[0, 2, 4, 6, 8, 10]])],
    ]
    (table,) = measure_lookups(_Bag(), batches, world_size=2)
    assert (table.name, table.rows, table.dim) == ("embedding.weight", 12, 5)
    assert table.unique == pytest.approx((4 + 3 + 1 + 6) / 4)
    assert table.largest == pytest.approx((4 + 6) / 2)
    # ids owned by the other rank: at step 0 rank 0 needs {1, 3} from rank 1, rank 1 none
    # (1, 3, 5 are its own); at step 1 rank 0 none, rank 1 all six (even: rank 0's)
    assert table.per_peer == pytest.approx((2 + 0 + 0 + 6) / 4)
    with pytest.raises(ValueError, match=r"no nn\.Embedding layers"):
        measure_lookups(nn.Linear(3, 3), batches, world_size=2)


def test_lookups_refuse_what_the_embedding_methods_refuse() -> None:
    batches = [[torch.tensor([[0, 1]]), torch.tensor([[2, 3]])]]
    tied = _Bag()
    tied.head = nn.Linear(5, 12)
    tied.head.weight = tied.embedding.weight  # a tied output projection
    with pytest.raises(ValueError, match="shares its weight"):
        measure_lookups(tied, batches, world_size=2)
    padded = _Bag()
    padded.embedding = nn.Embedding(12, 5, padding_idx=0)
    with pytest.raises(ValueError, match="uses padding_idx"):
        measure_lookups(padded, batches, world_size=2)

    class Twice(_Bag):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) + super().forward(ids)

    with pytest.raises(ValueError, match="looked up 2 times in one forward pass"):
        measure_lookups(Twice(), batches, world_size=2)

    class Unused(_Bag):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(torch.zeros(ids.shape[0], 5))

    (table,) = measure_lookups(Unused(), batches, world_size=2)
    assert (table.unique, table.largest, table.per_peer) == (0.0, 0.0, 0.0)


def test_embedding_methods_send_the_tables_traffic_and_ddp_the_rest() -> None:
    model = _Bag()
    params = [(n, p.detach()) for n, p in model.named_parameters()]
    table = TableLookups("embedding.weight", 12, 5, unique=6.0, largest=7.0, per_peer=2.0)
    with pytest.raises(ValueError, match="profile it with its task"):
        measure_method("emb-sharded", params, world_size=2)
    dense = measure_method("dense", params[1:], world_size=2)  # the head alone
    for method in ("emb-sharded", "emb-allgather"):
        cost = measure_method(method, params, world_size=2, lookups=[table])
        traffic = table_traffic(method, [table], {"prefetch": True}, world_size=2)
        assert cost.buckets[:-1] == dense.buckets
        assert cost.buckets[-1].collectives == traffic.backward
        assert cost.forward_collectives == traffic.forward
        assert cost.background_collectives == traffic.background
        assert cost.dense_bytes == sum(p.numel() * 4 for _, p in params)
    sharded = measure_method("emb-sharded", params, world_size=2, lookups=[table])
    assert len(sharded.forward_collectives) == 1 and len(sharded.background_collectives) == 2
    compressed = measure_method(
        "emb-sharded",
        params,
        world_size=2,
        options={"compressor": "fp16"},
        lookups=[table],
    )
    assert compressed.buckets[0].collectives[0].nbytes == dense.payload_bytes // 2


def test_the_packages_tasks_embedding_methods_are_profiled_from_its_batches() -> None:
    from thinwire.plan.profile import profile_task
    from thinwire.tasks import task

    profile = profile_task(
        task("packages", vocab_size=2048, batch_size=8),
        {"dense": None, "emb-sharded": None, "emb-allgather": None},
        world_size=4,
        repeats=1,
        method_repeats=1,
    )
    link = Link(100e6, 1e-3)
    dense, sharded, gathered = (
        profile.predict(m, link) for m in ("dense", "emb-sharded", "emb-allgather")
    )
    assert sharded.sent_bytes < gathered.sent_bytes < dense.sent_bytes / 4
    assert sharded.step_s < dense.step_s
