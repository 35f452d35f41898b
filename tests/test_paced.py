"""The paced all-to-all: the same answer as ``all_to_all_single`` whatever the windows (one
partner at a time, a different window on each rank, all at once, a different budget on each
rank), with uneven and empty
messages, on a subgroup too, and a window that fits the byte budget."""

from __future__ import annotations

import pytest
import torch

from thinwire.comm.paced import window_of


def test_the_window_holds_as_many_of_the_largest_message_as_fit_the_budget() -> None:
    assert window_of([10, 100, 40, 40], rank=0, budget=250) == 2
    assert window_of([1000, 100, 40, 40], rank=0, budget=250) == 2  # its own is not sent
    assert window_of([10, 100, 40, 40], rank=1, budget=50) == 1  # at least one partner
    assert window_of([10, 1, 1, 1], rank=0, budget=10**6) == 3  # at most N - 1: all at once
    assert window_of([0, 0, 0, 0], rank=2, budget=1) == 3  # nothing to send: all at once
    assert window_of([10, 10**9, 1, 1], rank=0, budget=0) == 3  # pacing off


def test_the_environment_sets_the_budget_at_import() -> None:
    import os
    import subprocess
    import sys

    script = "from thinwire.comm.paced import PACE_BYTES; print(PACE_BYTES)"
    cases = (("131072", "131072"), ("4096", "4096"), ("0", "0"), (None, "131072"), ("", "131072"))
    for value, wanted in cases:  # unset or empty: the default, 128 KiB
        env = {k: v for k, v in os.environ.items() if k != "THINWIRE_PACE_BYTES"}
        if value is not None:
            env["THINWIRE_PACE_BYTES"] = value
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.stdout.strip() == wanted, done.stderr
    env["THINWIRE_PACE_BYTES"] = "128k"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "whole number of bytes" in done.stderr


def _sizes(source: int, world: int) -> list[int]:
    """What ``source`` sends each rank: uneven, one of them empty."""
    return [0 if (source + dest) % 5 == 4 else 3 + 7 * source + 2 * dest for dest in range(world)]


def _message(source: int, world: int) -> torch.Tensor:
    sizes = _sizes(source, world)
    return torch.arange(sum(sizes), dtype=torch.int64) + 1000 * source


def _paced_on_gloo(rank: int, world: int, budget: int, subgroup: bool) -> list[list[int]]:
    import torch.distributed as dist

    from thinwire.comm.paced import paced_all_to_all

    group = None
    if subgroup:  # ranks 1..3 as a group of three, where group ranks are not global ones
        group = dist.new_group([1, 2, 3])
        if rank == 0:
            return []
        rank, world = dist.get_rank(group), 3
    every = [_sizes(source, world) for source in range(world)]
    sent, received = every[rank], [row[rank] for row in every]
    found = torch.full((sum(received),), -1, dtype=torch.int64)
    # budget -1: the ranks' budgets differ (one does not pace at all; the rest do)
    budgets = [0, 1, 10**9, 400][:world] if budget == -1 else [budget] * world
    paced_all_to_all(
        found, _message(rank, world), received, sent, every, group=group, budgets=budgets
    )
    wanted = torch.empty_like(found)
    dist.all_to_all_single(wanted, _message(rank, world), received, sent, group=group)
    return [found.tolist(), wanted.tolist()]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "budget", [1, 400, 10**9, -1], ids=["one-at-a-time", "mixed", "all", "budgets-differ"]
)
@pytest.mark.parametrize("subgroup", [False, True], ids=["world", "subgroup"])
def test_paced_messages_arrive_as_all_to_all_delivers_them(
    pool4, budget: int, subgroup: bool
) -> None:
    results = pool4.run(_paced_on_gloo, budget, subgroup)
    checked = 0
    for result in results:
        if not result:
            continue
        found, wanted = result
        assert found == wanted and -1 not in found
        checked += 1
    assert checked == (3 if subgroup else 4)
    if budget == 400 and not subgroup:  # the ranks pace differently: none waits forever
        windows = [window_of([8 * n for n in _sizes(r, 4)], r, budget) for r in range(4)]
        assert windows == [3, 3, 2, 1]
