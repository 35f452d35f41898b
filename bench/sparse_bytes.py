"""Bytes per rank per step of a sparse exchange against the number of ranks.

    python bench/sparse_bytes.py --task fashion --density 0.001 \\
        --ranks 4,8,16,32,64,128,256 --model-to 1024 --out docs/results/sparse-bytes.json

Real gradients: rank r's gradient at step s is the task model's gradient on the batch the
task gives rank r of N at step s (one model, its initial weights). Each world size runs
two steps of top-k through the real exchange protocols, every rank simulated in this
process (:func:`thinwire.compress.simulated.drive_ranks`): the first step sets the
partitions (re-balanced on its selection), the second is measured. For each world size:
the payload bytes the most loaded rank sends (and the mean over ranks), summed over the
model's compressed tensors,
for (a) gathering every rank's k entries (thinwire's top-k and DGC today), (b) the
partitioned sparse all-reduce, (c) a dense ring all-reduce of those tensors; and k
entries' bytes (8 bytes each), the yardstick of the issue's "within 3x".

Past the largest simulated world size the bytes are modelled, not simulated: gather
``8 k (N - 1)``, dense ``2 (N - 1) / N * 4 n``, partitioned the largest simulated
world's bytes per k entry (its imbalance included) held constant, which is what the
protocol's bytes do once N is large (``2 (N - 1) / N`` of ~2k entries and the
histograms).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from thinwire.compress import Slot
from thinwire.compress.base import num_selected
from thinwire.compress.partitioned import ENTRY_BYTES
from thinwire.compress.simulated import drive_ranks
from thinwire.compress.topk import TopK
from thinwire.tasks import task as make_task


def _gradients(task_name: str, world: int, step: int) -> dict[str, list[torch.Tensor]]:
    """Per compressed tensor (dim > 1), every rank's gradient at ``step``."""
    task = make_task(task_name)
    model = task.build_model()
    per_tensor: dict[str, list[torch.Tensor]] = {}
    for rank in range(world):
        model.zero_grad(set_to_none=True)
        inputs, targets = task.batch(rank, world, step)
        task.loss(model(inputs), targets).backward()
        for name, param in model.named_parameters():
            if param.dim() > 1:
                per_tensor.setdefault(name, []).append(param.grad.detach().clone())
    return per_tensor


def _one_world(task_name: str, world: int, density: float) -> dict:
    """Bytes of the most loaded rank at the second step, gather and partitioned."""
    row: dict = {"world": world, "dense": 0, "k_entries": 0}
    modes = {}
    for mode in ("gather", "partitioned"):
        partitioned = mode == "partitioned"
        modes[mode] = [
            TopK(density=density, partitioned=partitioned, rebalance_every=1) for _ in range(world)
        ]
    for step in (0, 1):
        grads = _gradients(task_name, world, step)
        for mode, comps in modes.items():
            sent = [0] * world
            for name, tensors in grads.items():
                protocols = [comps[r].exchange(tensors[r], Slot(name, step, world, r))
                             for r in range(world)]  # fmt: skip
                _, by_rank = drive_ranks(protocols)
                sent = [a + b for a, b in zip(sent, by_rank, strict=True)]
            row[mode], row[f"{mode}_mean"] = max(sent), sum(sent) / world
    for tensors in grads.values():
        numel = tensors[0].numel()
        row["dense"] += 2 * (world - 1) * 4 * numel // world
        row["k_entries"] += ENTRY_BYTES * num_selected(numel, density)
    return row


def _modelled(last: dict, world: int) -> dict:
    k_bytes = last["k_entries"]
    numel_bytes = last["dense"] * last["world"] // (2 * (last["world"] - 1))
    return {
        "world": world,
        "modelled": True,
        "gather": k_bytes * (world - 1),
        "partitioned": last["partitioned"],
        "partitioned_mean": last["partitioned_mean"],
        "gather_mean": k_bytes * (world - 1),
        "dense": 2 * (world - 1) * numel_bytes // world,
        "k_entries": k_bytes,
    }


def main(argv: list[str] | None = None) -> None:
    """Simulate, model, write the JSON and a plot, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="fashion")
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--ranks", default="4,8,16,32,64")
    parser.add_argument("--model-to", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("sparse-bytes.json"))
    args = parser.parse_args(argv)
    try:
        worlds = sorted({int(n) for n in args.ranks.split(",")})
    except ValueError:
        parser.error(f"--ranks takes world sizes separated by commas, got {args.ranks!r}")
    if worlds[0] < 2:
        parser.error("--ranks: every world size must be at least 2")
    torch.manual_seed(0)
    rows = []
    for world in worlds:
        started = time.perf_counter()
        rows.append({**_one_world(args.task, world, args.density), "modelled": False})
        print(f"N={world}: simulated in {time.perf_counter() - started:.0f} s", flush=True)
    world = worlds[-1] * 2
    while world <= args.model_to:
        rows.append(_modelled(rows[len(worlds) - 1], world))
        world *= 2
    result = {"task": args.task, "density": args.density, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    _plot(rows, args.out.with_suffix(".png"), args.task, args.density)
    print(f"{'N':>5} {'gather':>12} {'partitioned':>12} {'dense':>12}  "
          "partitioned / k entries: most loaded rank, mean")  # fmt: skip
    for row in rows:
        ratio = row["partitioned"] / row["k_entries"]
        mean = row["partitioned_mean"] / row["k_entries"]
        mark = " (modelled)" if row["modelled"] else ""
        print(f"{row['world']:>5} {row['gather']:>12,} {int(row['partitioned']):>12,} "
              f"{row['dense']:>12,}  {ratio:.2f}, {mean:.2f}{mark}")  # fmt: skip


def _plot(rows: list[dict], path: Path, task: str, density: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    worlds = [r["world"] for r in rows]
    for key, label in (("gather", "all-gather of top-k"), ("partitioned", "partitioned"),
                       ("dense", "dense ring")):  # fmt: skip
        axes.plot(worlds, [r[key] / 1e6 for r in rows], marker="o", label=label)
    axes.plot(worlds, [3 * r["k_entries"] / 1e6 for r in rows], "k--", label="3x k entries")
    simulated = max(r["world"] for r in rows if not r["modelled"])
    axes.axvline(simulated, color="grey", lw=0.5)
    title = f"{task}, density {density}: simulated to {simulated}, modelled after"
    axes.set(xscale="log", yscale="log", xlabel="ranks", ylabel="MB sent per rank per step",
             title=title)  # fmt: skip
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
