"""What a global top-k leaves in DGC's memories as the number of ranks grows.

    python bench/partitioned_drift.py --ranks 16 --density 0.01 --steps 2000 \\
        --out docs/results/sparse/drift-16ranks.json

N ranks simulated in this process, each with thinwire's own DGC compressor and DGC memory
(momentum correction, warm-up), exchanging through the real protocols
(:func:`thinwire.compress.simulated.exchange_on_ranks`): gathering every rank's k
entries, and ``partitioned`` (the global top-k of their sum), and with ``--keep K`` the
partitioned exchange keeping the global top ``K k`` (DGC's ``keep``). The model is a
small MLP (784-128-10) on Fashion-MNIST, trained with each rank's own batch (per-rank
gradients in one pass, ``torch.func.vmap``), SGD with cosine decay; its two weight
matrices are compressed, its biases averaged densely. A diagnostic of the mechanism, not
the quality table's model (the ResNet runs with real ranks in ``thinwire bench``).

For each exchange it reports, over the steps past the warm-up: the share of the entries
the ranks picked that were applied (gathering applies all of them), the entries applied a
step, the norm of the ranks' accumulators ``v`` (what waits in the memories) against the
gathered run's, and the held-out accuracy at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.func import grad, vmap

from thinwire.compress import Slot
from thinwire.compress.base import num_selected
from thinwire.compress.dgc import DGC
from thinwire.compress.simulated import exchange_on_ranks
from thinwire.tasks.fashion import load_fashion

HIDDEN = 128
COMPRESSED = ("w0", "w1")


def initial_params(seed: int) -> dict[str, Tensor]:
    """The MLP's weights, uniform in +-1/sqrt(fan_in) as ``nn.Linear`` draws them."""
    generator = torch.Generator().manual_seed(seed)
    params = {}
    for i, (fan_in, fan_out) in enumerate([(784, HIDDEN), (HIDDEN, 10)]):
        bound = 1 / math.sqrt(fan_in)
        params[f"w{i}"] = (torch.rand(fan_out, fan_in, generator=generator) * 2 - 1) * bound
        params[f"b{i}"] = (torch.rand(fan_out, generator=generator) * 2 - 1) * bound
    return params


def logits(params: dict[str, Tensor], images: Tensor) -> Tensor:
    """The MLP's output for flattened images."""
    hidden = torch.relu(images @ params["w0"].T + params["b0"])
    return hidden @ params["w1"].T + params["b1"]


def loss(params: dict[str, Tensor], images: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy of the MLP on one batch."""
    return torch.nn.functional.cross_entropy(logits(params, images), labels)


def train(args: argparse.Namespace, partitioned: bool, keep: int = 1) -> dict[str, Any]:
    """One run of ``args.steps`` steps; the exchange's statistics and the accuracy
    (``partitioned`` keeps the global top ``keep * k``)."""
    data = load_fashion()
    images, labels = data.normalise(data.train_x).flatten(1), data.train_y
    params = initial_params(args.seed)
    options = {"density": args.density, "warmup_steps": args.warmup, "partitioned": partitioned}
    if keep > 1:
        options["keep"] = keep
    compressors = [DGC(**options) for _ in range(args.ranks)]
    memories = [c.make_memory() for c in compressors]
    momentum = {name: torch.zeros_like(p) for name, p in params.items() if name not in COMPRESSED}
    per_rank_grads = vmap(grad(loss), in_dims=(None, 0, 0))
    generator = torch.Generator().manual_seed(args.seed)
    kept_shares, applied, norms = [], [], []
    for step in range(args.steps):
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        pick = torch.randint(len(images), (args.ranks, args.batch), generator=generator)
        grads = per_rank_grads(params, images[pick], labels[pick])
        for name in params:
            if name not in COMPRESSED:  # DGC's momentum, applied densely
                momentum[name].mul_(compressors[0].momentum).add_(grads[name].mean(0))
                params[name] = params[name] - lr * momentum[name]
                continue
            slots = [Slot(name, step, args.ranks, r) for r in range(args.ranks)]
            corrected = [
                m.compensate(grads[name][r], s)
                for r, (m, s) in enumerate(zip(memories, slots, strict=True))
            ]
            outcomes, _ = exchange_on_ranks(compressors, corrected, name, step)
            for memory, v, outcome, slot in zip(memories, corrected, outcomes, slots, strict=True):
                memory.update(v, outcome, slot, compressed=True)
            if step >= args.warmup:
                picked = args.ranks * num_selected(corrected[0].numel(), args.density)
                sent = sum(o.sent_indices.unique().numel() for o in outcomes)
                kept_shares.append(sent / picked)
                applied.append(int((outcomes[0].mean != 0).sum()))
            params[name] = params[name] - lr * outcomes[0].mean.view_as(params[name])
        for memory in memories:
            memory.commit()
        if step >= args.warmup and ((step - args.warmup) % 50 == 0 or step == args.steps - 1):
            norms.append(
                math.sqrt(
                    sum(float(v.square().sum()) for m in memories for v in m.accumulators.values())
                )
            )
    test = data.normalise(data.test_x).flatten(1)
    accuracy = float((logits(params, test).argmax(1) == data.test_y).float().mean())
    return {
        "exchange": "partitioned" if partitioned else "gathered",
        "keep": keep,
        "picked_and_applied": statistics.fmean(kept_shares),
        "applied_per_tensor_step": statistics.fmean(applied),
        "memory_norm": statistics.fmean(norms),
        "accuracy": accuracy,
    }


def main() -> None:
    """Both exchanges with the same ranks, data and seed; print and write the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8, help="examples a rank a step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--keep", type=int, default=1,
        help="also run the partitioned exchange keeping the global top keep*k (DGC's keep)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps:
        parser.error(
            f"--warmup must be in 0..steps-1 (the statistics are taken after it), got {args.warmup}"
        )
    if args.keep < 1:
        parser.error(f"--keep must be an integer >= 1, got {args.keep}")
    torch.set_num_threads(1)
    rows = []
    runs = [(False, 1), (True, 1)] + ([(True, args.keep)] if args.keep > 1 else [])
    for partitioned, keep in runs:
        started = time.perf_counter()
        row = train(args, partitioned, keep)
        row["seconds"] = round(time.perf_counter() - started, 1)
        rows.append(row)
        print(
            f"{row['exchange']:>11} (keep {keep}): {row['picked_and_applied']:6.1%} of the "
            f"picked entries applied, {row['applied_per_tensor_step']:8.0f} applied a tensor "
            f"a step, memories' norm {row['memory_norm']:8.1f}, accuracy {row['accuracy']:.2%} "
            f"({row['seconds']} s)",
            flush=True,
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"config": vars(args) | {"out": str(args.out)}, "runs": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
