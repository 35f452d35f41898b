"""Accelerate + thinwire, with gradient accumulation: two epochs straight against one epoch,
``accelerator.save_state``, a fresh job's ``load_state`` and the second epoch. Each rank
writes whether its weights ended the same and the engine's steps.

    torchrun --nproc-per-node 2 accelerate_resume.py OUT
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate import Accelerator
from shared import COMPRESSORS, arguments, dataset, model, weights
from torch.nn import functional as F
from torch.utils.data import DataLoader

from thinwire.integrations.accelerate import register


def job(name: str) -> tuple:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    net, opt = model(), None
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = DataLoader(dataset(), batch_size=8)  # 6 micro-batches, 3 steps an epoch a rank
    net, opt, loader = accelerator.prepare(net, opt, loader)
    engine = register(accelerator, net, name, optimizer=opt, **COMPRESSORS[name])
    return accelerator, net, opt, loader, engine


def epoch(accelerator, net, opt, loader) -> None:  # type: ignore[no-untyped-def]
    for x, y in loader:
        with accelerator.accumulate(net):
            accelerator.backward(F.cross_entropy(net(x), y))
            opt.step()
            opt.zero_grad()


def main() -> None:
    (out,) = arguments()
    out = Path(out)
    summary = {}
    for name in COMPRESSORS:
        accelerator, net, opt, loader, engine = job(name)
        epoch(accelerator, net, opt, loader)
        epoch(accelerator, net, opt, loader)
        straight, straight_steps = weights(net), engine.step
        ratios = [s.compression_ratio for s in engine.history]

        accelerator, net, opt, loader, engine = job(name)
        epoch(accelerator, net, opt, loader)
        accelerator.save_state(str(out / f"{name}-state"))
        accelerator, net, opt, loader, engine = job(name)
        accelerator.load_state(str(out / f"{name}-state"))
        epoch(accelerator, net, opt, loader)
        summary[name] = {
            "same": all(map(torch.equal, straight, weights(net))),
            "steps": [straight_steps, engine.step],
            "ratios": ratios,
        }
    rank = torch.distributed.get_rank()
    (out / f"summary-rank{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
