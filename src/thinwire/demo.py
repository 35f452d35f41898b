"""``thinwire demo`` (what ``make demo`` runs): a quick benchmark on an emulated cluster,
then the hybrid planner's choice measured beside the runner-up and pure data parallelism.

Four emulated hosts joined by 100 Mbit/s links with 1 ms latency train the Fashion-MNIST
ResNet-18 (width 32) for a few steps under dense DDP, PyTorch's PowerSGD hook and
thinwire's DGC, PowerSGD and 1-bit SGD, beside ``local`` (no exchange: the compute-only
limit). It prints the table and writes ``runs/demo/results.json`` and ``bench.png``: a
few minutes on two cores. Without root (no namespaces) it runs on plain loopback and says
so. The full measurements are ``thinwire bench`` runs; docs/measurements.md lists their
commands. The second part (:mod:`thinwire.bench.plan_demo`) probes 2 emulated hosts of 4
ranks, plans a 27 M-parameter GPT for them and runs three plans on virtual accelerators,
prediction beside measurement (``--part plan`` runs it alone, ``--part dp`` the first).
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from thinwire.bench.command import add_arguments, run_from_args
from thinwire.cluster import check_can_emulate

DEMO_DEFAULTS = {
    "task": "fashion",
    "workers": 4,
    "bandwidth": "100mbit",
    "latency": "1ms",
    "steps": 20,
    "methods": "local,dense,ddp-powersgd,dgc,powersgd,onebit",
    "task_options": '{"eval_examples": 2000}',
    "out": "runs/demo",
}


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """``thinwire bench``'s options with the demo's defaults."""
    add_arguments(parser)
    parser.add_argument(
        "--part", choices=("all", "dp", "plan"), default="all",
        help="dp: the data-parallel benchmark; plan: the hybrid planner's demo; all: both",
    )  # fmt: skip
    parser.set_defaults(**DEMO_DEFAULTS)


def run_demo(args: argparse.Namespace) -> int:
    """Run the quick benchmark, on loopback if this process cannot build namespaces."""
    reason = check_can_emulate()
    console = Console() if sys.stdout.isatty() else Console(width=150)  # whole tables in logs
    code = 0
    if args.part in ("all", "dp"):
        if args.network == "emulated" and reason is not None:
            console.print(
                f"[yellow]note:[/] {reason}\nrunning on plain loopback instead "
                "(no bandwidth limit: the timings show compute and compression only)"
            )
            args.network = "loopback"
        code = run_from_args(args)
    if args.part in ("all", "plan") and code == 0:
        if reason is not None:
            console.print(
                f"[yellow]note:[/] the planner's demo needs the emulated cluster: {reason}; "
                "plan without running: thinwire plan --model gpt --hosts 2 --ranks-per-host 4 "
                "--bandwidth 100mbit"
            )
            return code
        from pathlib import Path

        from thinwire.bench.plan_demo import run_plan_demo

        run_plan_demo(Path(args.out), console=console)
    return code
