"""The ``thinwire bench`` command: arguments, the run, the table, the plot."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from thinwire.data_parallel.buckets import parse_bucket_spec

#: learning rates that train each task well with SGD (momentum 0.9) at its default batch
DEFAULT_LR = {"digits": 0.1, "fashion": 0.05, "text": 0.5, "packages": 1.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``thinwire bench``."""
    parser.add_argument("--task", default="fashion", help="digits, fashion, text or packages")
    parser.add_argument("--workers", type=int, default=4, help="ranks = emulated hosts")
    parser.add_argument(
        "--ranks-per-host",
        type=int,
        default=1,
        help="with --plans: ranks per emulated host, sharing its loopback (default 1)",
    )
    parser.add_argument("--bandwidth", default="100mbit", help="per link, e.g. 10mbit, 1gbit")
    parser.add_argument("--latency", default="1ms", help="one-way delay between two hosts")
    parser.add_argument(
        "--uplink-queue",
        type=int,
        default=None,
        help="packets each emulated host's uplink queue holds (default: 10 ms of the link); "
        "256 keeps the bursts of an all-to-all among many hosts (docs/sparse.md)",
    )
    parser.add_argument(
        "--methods",
        default="local,dense,ddp-fp16,ddp-powersgd,fp16,dgc,powersgd,onebit,terngrad",
        help=(
            "comma-separated: local, dense, ddp-fp16, ddp-powersgd, dga, ps-sync, ps-async, "
            "local-sgd, diloco, emb-allgather, emb-sharded (tasks with embeddings: "
            "packages), or thinwire compressors (thinwire strategies lists them all)"
        ),
    )
    parser.add_argument("--options", default="", help="JSON per method: '{\"dgc\": {...}}'")
    parser.add_argument(
        "--plans",
        default="",
        help="hybrid-parallel plans to train side by side instead of --methods (task gpt), "
        "e.g. '8x1x1 2x2x2/mb4:powersgd(rank=4)' (DPxPPxTP[/mbN][/SCHEDULE][:METHOD(k=v)])",
    )
    parser.add_argument(
        "--optimizer",
        choices=["adamw", "sgd"],
        default="adamw",
        help="with --plans: AdamW (default) or SGD with --momentum",
    )
    parser.add_argument(
        "--servers",
        type=int,
        default=None,
        help="server shards K of ps-sync and ps-async (ranks 0..K-1 also serve; default 1)",
    )
    parser.add_argument("--task-options", default="", help="JSON, e.g. '{\"batch_size\": 64}'")
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="HOST:KIND=VALUE@STEP",
        help="break a host's link when each method's run reaches STEP: down=5s (an outage), "
        "loss=0.01 (a share of packets lost), rate=10mbit (slowed); repeatable; "
        "emulated network only, e.g. --fault 1:down=5s@20",
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps per method")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the method list this many times, reversing its order every other time, "
        "and report each method's median and spread over the repeats (for machines whose "
        "speed drifts between runs)",
    )
    parser.add_argument(
        "--measure-from",
        type=int,
        default=None,
        help="first step in the timings (default: after warm-up)",
    )
    parser.add_argument("--lr", type=float, default=None, help="learning rate (per-task default)")
    parser.add_argument(
        "--lr-schedule",
        choices=["constant", "cosine"],
        default="constant",
        help="cosine: decay the learning rate to 0 over --steps (for quality runs)",
    )
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--network",
        choices=["emulated", "loopback"],
        default="emulated",
        help="emulated cluster (root) or plain loopback (no limits)",
    )
    add_ddp_arguments(parser)
    parser.add_argument(
        "--no-fuse-rounds",
        action="store_true",
        help="run each bucket's compressor rounds alone instead of sending a bucket's "
        "later rounds with the next bucket's first (thinwire compressors of several "
        "rounds, under DDP and dga)",
    )
    parser.add_argument(
        "--compute",
        choices=["real", "sleep"],
        default="real",
        help="sleep: replace the model's compute by sleeps of its measured stage times, as "
        "on an accelerator that leaves the CPU to the network (timings only; no eval)",
    )
    parser.add_argument(
        "--untimed-steps",
        type=int,
        default=3,
        metavar="N",
        help="with --plans --compute sleep: leave the first N of --steps out of the step "
        "time (a plan's first steps warm its ranks' memory and sockets; default 3)",
    )
    parser.add_argument(
        "--step-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --plans --compute sleep: a plan whose first step says its --steps would "
        "take longer than SECONDS warms up at most two steps and is timed for as many as "
        "fit, at least two (a sweep of slow links; default: every plan runs --steps)",
    )
    parser.add_argument(
        "--compute-speedup",
        type=float,
        default=1.0,
        metavar="N",
        help="with --compute sleep: sleep each stage's measured time divided by N, a virtual "
        "accelerator N times this CPU (a GPU steps a small model tens of times faster; "
        "default 1)",
    )
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out metric")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds one method's run may take before it is stopped (default 3600; long "
        "quality runs need more)",
    )
    parser.add_argument("--out", default="runs/bench", help="directory for results and plots")


def add_ddp_arguments(parser: argparse.ArgumentParser) -> None:
    """The DDP options ``thinwire bench`` runs with and ``thinwire plan`` models."""
    parser.add_argument(
        "--bucket-cap-mb",
        type=_bucket_spec,
        default=None,
        help="DDP bucket size in MB, or 'tapered': large buckets first, small ones at the "
        "end of the backward pass (thinwire.tapered_buckets; 'tapered:TAIL:FACTOR' sets the "
        "last bucket's least MB and the growth per bucket, default 0.05 and 4; default: "
        "DDP's own, 1 MB then 25 MB)",
    )
    parser.add_argument(
        "--no-broadcast-buffers",
        action="store_true",
        help="DDP without its broadcast of rank 0's batch-norm "
        "statistics before every forward pass (each rank keeps its own; eval uses rank 0's)",
    )


def _bucket_spec(text: str) -> float | str:
    """``--bucket-cap-mb``'s value; argparse reports a ``ValueError``'s message as given."""
    try:
        return parse_bucket_spec(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _json_option(flag: str, text: str | None) -> Any:
    """``text`` parsed as JSON (``{}`` when not given); an error names the flag."""
    if not text:
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag} is not valid JSON ({error}): {text!r}") from None


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark the arguments describe; print the table, write JSON and plots."""
    from thinwire.bench.faults import parse_fault
    from thinwire.bench.methods import parse_methods
    from thinwire.bench.repeats import summarise_repeats
    from thinwire.bench.report import plot, repeats_table, results_table, timing_warnings
    from thinwire.bench.runner import BenchConfig, run_bench
    from thinwire.tasks import task_class

    console = Console() if sys.stdout.isatty() else Console(width=150)  # whole table in logs
    if args.plans:
        return run_plans_from_args(args, console)
    try:
        task_class(args.task)
        options = _json_option("--options", args.options)
        if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
            raise ValueError(
                f"--options must map method names to option objects, e.g. "
                f'\'{{"dgc": {{"density": 0.01}}}}\', got {args.options!r}'
            )
        if args.servers is not None:
            listed = {name.strip() for name in args.methods.split(",")}
            if not listed & {"ps-sync", "ps-async"}:
                raise ValueError(
                    "--servers sets the shards of ps-sync and ps-async, and --methods lists "
                    "neither: add one, or leave --servers out"
                )
            for name in ("ps-sync", "ps-async"):
                if name in listed:
                    options.setdefault(name, {}).setdefault("servers", args.servers)
        task_options = _json_option("--task-options", args.task_options)
        config = BenchConfig(
            task=args.task,
            methods=parse_methods(args.methods, options, args.steps),
            workers=args.workers,
            bandwidth=args.bandwidth,
            latency=args.latency,
            uplink_queue=args.uplink_queue,
            steps=args.steps,
            lr=args.lr if args.lr is not None else DEFAULT_LR.get(args.task, 0.05),
            momentum=args.momentum,
            weight_decay=args.weight_decay,
            seed=args.seed,
            task_options=task_options,
            network=args.network,
            measure_from=args.measure_from,
            evaluate=not args.no_eval,
            bucket_cap_mb=args.bucket_cap_mb,
            fuse_rounds=not args.no_fuse_rounds,
            lr_schedule=args.lr_schedule,
            compute=args.compute,
            compute_speedup=args.compute_speedup,
            broadcast_buffers=not args.no_broadcast_buffers,
            repeats=args.repeats,
            faults=tuple(parse_fault(f, args.workers, args.steps) for f in args.fault),
            timeout_s=args.timeout,
        )
    except (ValueError, TypeError) as error:  # JSONDecodeError is a ValueError
        console.print(f"[red]error:[/] {escape(str(error))}")
        return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        console.print(
            f"[red]error:[/] --out {escape(str(out))} is a file; give a directory (results.json "
            "and the plots go in it), e.g. runs/bench"
        )
        return 2
    try:
        records = run_bench(config, out, console)
    except (RuntimeError, OSError) as error:  # a failed rank, a timeout, no root, no data
        console.print(f"[red]error:[/] {escape(str(error))}")
        return 1
    console.print(results_table(records))
    if config.repeats > 1:
        summary = summarise_repeats(records)
        (out / "repeats.json").write_text(json.dumps(summary, indent=2))
        console.print(repeats_table(summary, config.repeats))
    for warning in timing_warnings(records):
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    picture = plot(records, out / "bench.png")
    written = "results.json" + (" and repeats.json" if config.repeats > 1 else "")
    console.print(f"results: {out}/{written}   plots: {picture}")
    return 0


def plain_printer(console: Console) -> Callable[[str], None]:
    """``console.print`` for text that is not markup: a failed plan's error quotes PyTorch's
    and gloo's messages, whose ``[file:line]`` rich would read as a closing tag (and raise,
    ending the sweep with the plans after it unrun)."""

    def report(text: str) -> None:
        console.print(text, markup=False)

    return report


def run_plans_from_args(args: argparse.Namespace, console: Console) -> int:
    """``thinwire bench --plans``: train hybrid-parallel plans side by side (real compute)."""
    from thinwire.bench.hybrid import HybridConfig, plot_losses, run_hybrid
    from thinwire.parallel.plan_spec import parse_plans

    if args.compute_speedup != 1:
        console.print(
            "[red]error:[/] --compute-speedup applies to --methods runs; --plans --compute "
            "sleep sleeps each stage's time as measured here: drop --compute-speedup"
        )
        return 2
    try:
        config = HybridConfig(
            task=args.task,
            plans=tuple(parse_plans(args.plans)),
            steps=args.steps,
            lr=args.lr if args.lr is not None else 3e-3,
            optimizer=args.optimizer,
            momentum=args.momentum,
            weight_decay=args.weight_decay,
            task_options=_json_option("--task-options", args.task_options) or {},
            timeout_s=args.timeout,
            network=args.network,
            ranks_per_host=args.ranks_per_host,
            bandwidth=args.bandwidth,
            latency=args.latency,
            compute=args.compute,
            uplink_queue=args.uplink_queue,
            untimed_steps=args.untimed_steps,
            step_budget_s=args.step_budget,
        )
    except (ValueError, TypeError) as error:
        console.print(f"[red]error:[/] {escape(str(error))}")
        return 2
    out = Path(args.out)
    try:
        sweep = run_hybrid(config, out, plain_printer(console))
    except (RuntimeError, OSError) as error:
        console.print(f"[red]error:[/] {escape(str(error))}")
        return 1
    records = sweep.records
    if not records:
        picture = "none (no plan ran)"
    elif config.compute == "sleep":
        from thinwire.bench.hybrid_sleep import plot_throughput

        title = f"{config.task}, {config.network} {config.bandwidth}, {config.latency}"
        picture = plot_throughput(records, out / "throughput.png", title)
    else:
        picture = plot_losses(records, out / "losses.png")
    console.print(f"results: {out}/results.json   plot: {picture}")
    for failure in sweep.failed:
        console.print(f"[red]failed:[/] {escape(failure['plan'])}: {escape(failure['error'])}")
    if sweep.failed:
        console.print(
            f"[red]error:[/] {len(sweep.failed)} of {len(config.plans)} plans failed (above, "
            "and under 'failed' in results.json): run them again with --plans"
        )
        return 1
    return 0
