"""The step's tail phases a sleeping bench run notes (thinwire.bench.step_phases)."""

from __future__ import annotations

import mmap
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from thinwire.bench.step_phases import ALONE_REPEATS, StepPhases, engine_split, exchange_alone

pytestmark = pytest.mark.timeout(60)


#: pages each synchronize of :class:`Wrapper` touches for the first time
FRESH_PAGES = 64


def touch_fresh_pages(count: int) -> None:
    """Map ``count`` pages of new anonymous memory and write to each: one minor fault each."""
    pages = mmap.mmap(-1, count * mmap.PAGESIZE)
    for offset in range(0, count * mmap.PAGESIZE, mmap.PAGESIZE):
        pages[offset] = 1
    pages.close()


class Wrapper:
    """Stands for thinwire's data-parallel wrapper: synchronize, then the inner step."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner
        self.synchronized = 0

    def synchronize(self) -> None:
        touch_fresh_pages(FRESH_PAGES)
        time.sleep(0.01)
        self.synchronized += 1

    def step(self) -> None:
        self.synchronize()
        self.optimizer.step()


def test_the_exchange_and_the_optimizer_step_are_noted_in_order() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    wrapper = Wrapper(torch.optim.SGD([weight], lr=0.5))
    phases = StepPhases(SimpleNamespace(optimizer=wrapper))
    wrapper.step()
    assert wrapper.synchronized == 1 and torch.equal(weight.detach(), torch.full((3,), 0.5))
    (exchange, step) = phases.events
    assert exchange[0] == "X" and step[0] == "O"
    assert exchange[2] - exchange[1] >= 0.01  # the exchange's own time
    assert phases.faults["X"] >= FRESH_PAGES and "O" not in phases.faults
    assert exchange[2] <= step[1] <= step[2]


def test_a_plain_optimizer_notes_only_its_step() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    phases = StepPhases(SimpleNamespace(optimizer=optimizer))
    optimizer.step()
    optimizer.step()
    assert [kind for kind, _, _ in phases.events] == ["O", "O"]
    assert all(start <= end for _, start, end in phases.events)


class Coordinate:
    """Stands for a device mesh's ``pp`` dimension: this rank's stage."""

    def __init__(self, stage: int) -> None:
        self.stage = stage

    def get_local_rank(self) -> int:
        return self.stage


def test_the_exchange_alone_is_timed_together_and_by_stage_without_touching_the_timeline() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    wrapper = Wrapper(torch.optim.SGD([weight], lr=0.5))
    stats = SimpleNamespace(compress_s=0.002, communicate_s=0.005)  # the engine's last step
    trainer = SimpleNamespace(
        optimizer=wrapper,
        plan=SimpleNamespace(dp=2, pp=3),
        mesh={"pp": Coordinate(1)},
        engine=SimpleNamespace(last_step=stats),
    )
    phases = StepPhases(trainer)
    wrapper.synchronize()
    noted = list(phases.events)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        alone = exchange_alone(trainer, phases)
    finally:
        dist.destroy_process_group()
    assert set(alone) == {
        f"{mode}{part}" for mode in ("together", "by_stage")
        for part in ("", "_compress", "_communicate", "_faults")
    }  # fmt: skip
    assert alone["together_faults"] >= FRESH_PAGES and alone["by_stage_faults"] >= FRESH_PAGES
    assert alone["together"] >= 0.01 and alone["by_stage"] >= 0.01  # the exchange's own time
    assert alone["together_compress"] == alone["by_stage_compress"] == 0.002
    assert alone["together_communicate"] == alone["by_stage_communicate"] == 0.005
    # one untimed and the timed repeats, each way; by stage only in this rank's turn
    assert wrapper.synchronized == 1 + 2 * (ALONE_REPEATS + 1)
    assert phases.events == noted  # the steps' timeline as it was
    assert phases.seconds("X") == pytest.approx(noted[0][2] - noted[0][1])


def test_no_exchange_alone_without_data_parallelism() -> None:
    wrapper = Wrapper(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    trainer = SimpleNamespace(optimizer=wrapper, plan=SimpleNamespace(dp=1, pp=2), mesh={})
    assert exchange_alone(trainer, StepPhases(trainer)) == {}
    assert wrapper.synchronized == 0


def test_the_engines_split_is_zero_without_an_engine_or_a_step() -> None:
    assert engine_split(SimpleNamespace(engine=None)) == (0.0, 0.0)
    assert engine_split(SimpleNamespace(engine=SimpleNamespace(last_step=None))) == (0.0, 0.0)
    stats = SimpleNamespace(compress_s=0.25, communicate_s=0.5)
    assert engine_split(SimpleNamespace(engine=SimpleNamespace(last_step=stats))) == (0.25, 0.5)
