"""``thinwire demo`` (what ``make demo`` runs): a quick benchmark on an emulated cluster.

Four emulated hosts joined by 100 Mbit/s links with 1 ms latency train the Fashion-MNIST
ResNet-18 (width 32) for a few steps under dense DDP, PyTorch's PowerSGD hook and
thinwire's DGC, PowerSGD and 1-bit SGD, beside ``local`` (no exchange: the compute-only
limit). It prints the table and writes ``runs/demo/results.json`` and ``bench.png``: a
few minutes on two cores. Without root (no namespaces) it runs on plain loopback and says
so. The full measurements are ``thinwire bench`` runs; docs/measurements.md lists their
commands.
"""

from __future__ import annotations

import argparse

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
    parser.set_defaults(**DEMO_DEFAULTS)


def run_demo(args: argparse.Namespace) -> int:
    """Run the quick benchmark, on loopback if this process cannot build namespaces."""
    reason = check_can_emulate()
    if args.network == "emulated" and reason is not None:
        Console().print(
            f"[yellow]note:[/] {reason}\nrunning on plain loopback instead "
            "(no bandwidth limit: the timings show compute and compression only)"
        )
        args.network = "loopback"
    return run_from_args(args)
