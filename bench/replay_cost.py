"""What delayed averaging's replay costs an optimizer without a closed-form correction.

    python bench/replay_cost.py [--task fashion] [--delays 1,2,4] [--repeats 20]

On one CPU thread, times the median of one Adam step on the task's model, and of one
replayed step (:mod:`thinwire.data_parallel.replay`: a consensus step on the averages, the live
weights and state set to the consensus, then D own steps again) for each delay D.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from thinwire.data_parallel.replay import ConsensusReplay, hyperparameters
from thinwire.tasks import task


def median_seconds(fn: Callable[[], None], repeats: int) -> float:
    """The median wall-clock time of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Print one Adam step's time and each delay's replayed step."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="fashion")
    parser.add_argument("--delays", default="1,2,4", help="comma-separated delays D >= 1")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = task(args.task).build_model()
    params = list(model.parameters())
    adam = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    adam.step()  # the moments exist, as in a run
    replay = ConsensusReplay(adam)
    replay.adopt_live()
    grads = {id(p): torch.randn_like(p) for p in params}
    hyper = hyperparameters(adam)
    plain = median_seconds(adam.step, args.repeats)
    print(f"{args.task}: {sum(p.numel() for p in params) / 1e6:.2f} M parameters")
    print(f"Adam step: {plain * 1e3:.1f} ms")
    for delay in (int(d) for d in args.delays.split(",")):

        def replayed(delay: int = delay) -> None:
            replay.advance(grads, hyper)
            replay.rebuild([(grads, hyper)] * delay)

        print(f"replayed step, D = {delay}: {median_seconds(replayed, args.repeats) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
