"""Delayed averaging with optimizers that have no closed-form correction: do ranks agree?

    python bench/dga_optimizers.py --out docs/results/dga-adam-digits.json
    python bench/dga_optimizers.py --optimizer sgd --lr 0.05 --momentum 0.9 \
        --weight-decay 0.01 --out docs/results/dga-sgd-wd-digits.json

Trains the digits MLP on N local ranks with Adam (or SGD), synchronously
(``thinwire.DistributedOptimizer``) and under ``thinwire.DelayedAveraging`` for each
delay, from the same weights on the same batches. Every ``--check-every`` steps (and at
the end) it flushes and records how far apart the ranks' weights are (the largest
``|w_i - mean| / |mean|`` over ranks); at the end, each rank's held-out accuracy. Ranks on
one consensus give 0 and one accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import thinwire
from thinwire.launch import run_local
from thinwire.tasks import task


def _spread(model: torch.nn.Module, world: int) -> float:
    """The largest relative distance of a rank's weights from the ranks' mean."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    mean = flat.clone()
    dist.all_reduce(mean)
    mean /= world
    spread = (flat - mean).norm() / mean.norm()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return float(spread)


def build_optimizer(
    name: str, params: Any, lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    """``adam`` or ``sgd`` (heavy-ball momentum) over ``params``."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


def train(
    rank: int, world: int, delay: int, steps: int, every: int, optimizer: dict[str, Any]
) -> dict:
    """One run on this rank: delay 0 is the synchronous optimizer."""
    digits = task("digits")
    model = digits.build_model()
    inner = build_optimizer(params=model.parameters(), **optimizer)
    if delay == 0:
        opt: Any = thinwire.DistributedOptimizer(inner, model)
    else:
        opt = thinwire.DelayedAveraging(inner, model, delay=delay)
    spreads = []
    for step in range(steps):
        x, y = digits.batch(rank, world, step)
        opt.zero_grad()
        digits.loss(model(x), y).backward()
        opt.step()
        if (step + 1) % every == 0 or step == steps - 1:
            if delay:
                opt.flush()
            spreads.append((step + 1, _spread(model, world)))
    final = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"spreads": spreads, "accuracy": digits.evaluate(model), "weights": final.tolist()}


def main(argv: list[str] | None = None) -> int:
    """Run every delay, print a line each and write the JSON file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD's")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--delays", default="0,1,4", help="comma-separated; 0: synchronous")
    parser.add_argument("--check-every", type=int, default=100)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    delays = [int(d) for d in args.delays.split(",")]
    optimizer = {
        "name": args.optimizer,
        "lr": args.lr,
        "momentum": args.momentum,
        "weight_decay": args.weight_decay,
    }
    records = []
    first: torch.Tensor | None = None
    for delay in delays:
        ranks = run_local(
            train,
            args.workers,
            args=(delay, args.steps, args.check_every, optimizer),
            timeout=1800,
        )
        record = {
            "optimizer": args.optimizer,
            "lr": args.lr,
            "momentum": args.momentum,
            "weight_decay": args.weight_decay,
            "task": "digits",
            "workers": args.workers,
            "steps": args.steps,
            "delay": delay,
            "front_end": "DistributedOptimizer" if delay == 0 else "DelayedAveraging",
            "spread_after_flush": ranks[0]["spreads"],
            "accuracy_per_rank": [r["accuracy"] for r in ranks],
        }
        weights = torch.tensor(ranks[0]["weights"])
        first = weights if first is None else first
        # how far this run ended from the first one (the synchronous run, by default)
        record["distance_from_first_run"] = float((weights - first).norm() / first.norm())
        records.append(record)
        accuracies = ", ".join(f"{a:.4f}" for a in record["accuracy_per_rank"])
        print(
            f"delay {delay}: spread {ranks[0]['spreads'][-1][1]:.3g} at the end, "
            f"accuracy per rank {accuracies}, "
            f"{record['distance_from_first_run']:.3g} from the first run's weights",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
