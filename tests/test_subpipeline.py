"""Sub-batches in turns (Merak's sub-pipelined tensor parallelism), in one process: the
turns interleave at collectives, errors stop every sub-batch, random streams, the stage's
gradients, the plan's option and the cost model's time of a pass in turns.

The multi-rank parity (losses and weights equal the run without sub-batches) is in
``test_parallel_parity.py``; the throughput in ``thinwire bench`` (docs/measurements.md).
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from thinwire.parallel import ParallelPlan
from thinwire.parallel.layout import read_layout
from thinwire.parallel.plan_spec import parse_plan
from thinwire.parallel.stages import StageModule
from thinwire.parallel.subpipeline import in_turns
from thinwire.plan.stage_profile import Collective, Pass, StageProfile
from thinwire.plan.turns import TurnPass, in_subbatches, in_turns_s, join_passes
from thinwire.tasks.transformer import TransformerConfig, TransformerLM

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake_group():
    """PyTorch's fake process group of 2 ranks (collectives return their input)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_a_sub_batch_hands_on_its_turn_while_its_all_reduce_runs(fake_group) -> None:
    log = []

    def job(i: int):
        def run() -> torch.Tensor:
            a = funcol.all_reduce(torch.ones(3), "sum", fake_group)
            log.append(f"issue {i}")
            b = a + 1  # waits for the all-reduce: the other sub-batch computes meanwhile
            log.append(f"use {i}")
            return b

        return run

    results = in_turns([job(0), job(1)])
    assert log == ["issue 0", "issue 1", "use 0", "use 1"]
    assert all(torch.equal(r, torch.full((3,), 2.0)) for r in results)


def test_an_error_in_one_sub_batch_stops_them_all(fake_group) -> None:
    def failing() -> None:
        funcol.all_reduce(torch.ones(3), "sum", fake_group).add_(1)
        raise ValueError("broken sub-batch")

    def waiting() -> torch.Tensor:
        a = funcol.all_reduce(torch.ones(3), "sum", fake_group)
        return a + funcol.all_reduce(a, "sum", fake_group) * 2

    with pytest.raises(ValueError, match="broken sub-batch"):
        in_turns([waiting, failing, waiting])


def test_sub_batches_run_on_the_same_threads_call_after_call() -> None:
    """DTensor caches its sharding decisions per thread: threads started afresh for each
    micro-batch worked them out again for every operation (4-7x slower steps)."""

    def idents() -> list[int]:
        return in_turns([threading.get_ident, threading.get_ident, threading.get_ident])

    first = idents()
    assert len(set(first)) == 3 and threading.get_ident() not in first
    assert idents() == first and idents()[:2] == in_turns([threading.get_ident] * 2)

    def subbatch_threads() -> set[int]:
        alive = threading.enumerate()
        return {t.ident for t in alive if t.name.startswith("thinwire-subbatch-")}

    # a forked child starts workers of its own (its parent's threads are not in it)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        signal.alarm(20)  # a child waiting on its parent's workers dies, closing the pipe
        try:
            os.write(write, b"ok" if len(set(idents())) == 3 else b"no")
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 2) == b"ok"
    os.waitpid(child, 0)

    before = subbatch_threads()
    owner = threading.Thread(target=idents)  # its workers go when it ends
    owner.start()
    owner.join()
    gc.collect()
    deadline = time.monotonic() + 10
    while subbatch_threads() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert subbatch_threads() == before


def test_each_sub_batch_draws_a_stream_of_its_own() -> None:
    torch.manual_seed(7)
    first = in_turns([lambda: torch.rand(4) for _ in range(2)], fresh_streams=True)
    after_first = torch.rand(1)
    torch.manual_seed(7)
    again = in_turns([lambda: torch.rand(4) for _ in range(2)], fresh_streams=True)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], first[1])
    torch.manual_seed(7)
    torch.randint(0, 2**62, (2,))  # the one draw that seeds the streams
    assert torch.equal(torch.rand(1), after_first)
    # without fresh streams each job starts from the caller's state, left as it was
    torch.manual_seed(3)
    same = in_turns([lambda: torch.rand(2) for _ in range(2)])
    assert torch.equal(same[0], same[1]) and torch.equal(torch.rand(2), same[0])


def stage(subbatches: int, recompute: float = 0.0) -> StageModule:
    torch.manual_seed(0)
    model = TransformerLM(
        TransformerConfig(vocab=64, dim=32, layers=3, heads=4, max_seq=8, dropout=0.1)
    )
    return StageModule(
        model, read_layout(model), range(3), first=True, last=True, recompute=recompute,
        subbatches=subbatches,
    )  # fmt: skip


def gradients(module: StageModule, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(5)
    logits = module(tokens)
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


def test_a_stage_in_sub_batches_computes_the_same_gradients() -> None:
    tokens = torch.randint(0, 64, (4, 8))
    plain, split = stage(1).eval(), stage(2).eval()  # no dropout: the same math per sample
    want_out, want = gradients(plain, tokens)
    out, got = gradients(split, tokens)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_recomputation_in_sub_batches_replays_their_dropout() -> None:
    tokens = torch.randint(0, 64, (4, 8))
    want_out, want = gradients(stage(2).train(), tokens)
    recomputing = stage(2, recompute=1.0).train()
    torch.manual_seed(5)
    logits = recomputing(tokens)
    assert recomputing.recompute_next()  # the sub-batches' segments, rebuilt ahead
    logits.square().mean().backward()
    assert recomputing.recomputation.recomputed == 2
    torch.testing.assert_close(logits.detach(), want_out, rtol=0, atol=0)
    for name, p in recomputing.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-6, atol=0, msg=name)


def test_the_plan_takes_sub_batches_and_refuses_what_cannot_run() -> None:
    plan = parse_plan("1x1x4/mb2/sb2")
    assert plan.subbatches == 2 and plan.spec() == "1x1x4/mb2/1f1b/sb2"
    with pytest.raises(ValueError, match="tp=1 has none"):
        ParallelPlan(subbatches=2)
    with pytest.raises(ValueError, match="subbatches must be an integer"):
        ParallelPlan(tp=2, subbatches=0)
    with pytest.raises(ValueError, match="do not split into subbatches=4"):
        ParallelPlan(tp=2, microbatches=2, subbatches=4).check_batch(12)
    with pytest.raises(ValueError, match="does not split into subbatches=3"):
        stage(3)(torch.randint(0, 64, (4, 8)))


def test_a_pass_in_turns_overlaps_each_all_reduce_with_the_next_sub_batch() -> None:
    on_the_wire = lambda nbytes: (0.0, 1.0)  # noqa: E731  (latency, seconds of bytes)
    one = TurnPass((1.0,), (100,), 0.0)
    # sub-batch 0 computes [0, 1], its all-reduce runs [1, 2] while sub-batch 1 computes;
    # sub-batch 1's all-reduce runs [2, 3]
    assert in_turns_s(one, 2, on_the_wire) == 3.0
    # two phases: the wire is the bottleneck once compute equals an all-reduce
    two = TurnPass((1.0, 1.0), (100, 100), 0.5)
    assert in_turns_s(two, 2, on_the_wire) == 5.5  # all-reduces end at 2, 3, 4, 5; tails 0.5
    assert in_turns_s(two, 1, on_the_wire) == 4.5
    # all-reduces in flight together overlap their latencies, not their bytes
    short = TurnPass((0.1,), (100,), 0.0)
    assert in_turns_s(short, 2, lambda nbytes: (1.0, 0.0)) == pytest.approx(1.2)
    assert in_turns_s(short, 2, on_the_wire) == pytest.approx(2.1)
    # a group runs at most at_once collectives: the third sub-batch's waits for the first's
    latency_only = lambda nbytes: (1.0, 0.0)  # noqa: E731
    assert in_turns_s(short, 4, latency_only) == pytest.approx(1.4)
    assert in_turns_s(short, 4, latency_only, at_once=2) == pytest.approx(2.2)
    assert in_turns_s(short, 4, latency_only, at_once=1) == pytest.approx(4.1)
    assert in_turns_s(short, 2, latency_only, at_once=2) == pytest.approx(1.2)  # no wait
    with pytest.raises(ValueError, match="at least one collective"):
        in_turns_s(short, 2, latency_only, at_once=0)
    # two issued at once take what the probe measured when it calibrated the share hidden:
    # 2 x bytes + (2 - share) x latency (here bytes 0.25, latency 1, half of it hidden)
    together = TurnPass((0.0,), (100,), 0.0)
    share, latency, wire = 0.5, 1.0, 0.25
    parts = lambda nbytes: (share * latency, wire + (1 - share) * latency)  # noqa: E731
    assert in_turns_s(together, 2, parts) == pytest.approx(2 * wire + (2 - share) * latency)
    assert in_turns_s(together, 1, parts) == pytest.approx(wire + latency)  # alone: all of it
    joined = join_passes([TurnPass((1.0,), (8,), 0.25), TurnPass((), (), 0.5), one])
    assert joined == TurnPass((1.0, 1.75), (8, 100), 0.0)


def test_a_profile_of_one_sub_batch_stands_for_the_micro_batch() -> None:
    collective = Collective(0.1, (2, 8, 32), "torch.float32")
    profile = StageProfile(
        0, Pass((collective,), 0.2), Pass((collective, collective), 0.3), (2, 8, 32),
        "torch.float32", ((32, 32),), loss_collectives=(Collective(0.0, (2, 8), "torch.float32"),),
        saved_bytes=1000, input_bytes=2048,
    )  # fmt: skip
    whole = in_subbatches(profile, 2)
    assert whole.output_shape == (4, 8, 32) and whole.saved_bytes == 2000
    assert whole.forward_s == pytest.approx(0.6) and whole.backward_s == pytest.approx(1.0)
    assert whole.loss_collectives[0].shape == (4, 8)
    per_allreduce = collective.nbytes
    assert sorted(whole.tp_allreduce_bytes) == [128] + [per_allreduce] * 6


def test_saved_tensor_hooks_see_the_sub_batches_activations() -> None:
    from thinwire.plan.activations import SavedActivations

    tokens = torch.randint(0, 64, (4, 8))
    measured = []
    for module in (stage(1).eval(), stage(2).eval()):
        with SavedActivations(exclude=list(module.parameters())) as saved:
            out = module(tokens)
            measured.append(saved.peak_bytes)
        del out
    assert measured[1] == pytest.approx(measured[0], rel=0.02)
