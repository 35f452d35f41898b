"""``thinwire probe``: measure the cluster's links on every rank, save them, print them."""

from __future__ import annotations

import argparse
import datetime
import os
import sys

from rich.console import Console
from rich.table import Table

from thinwire.plan.network import format_rate
from thinwire.plan.probe import LinkProbe, run_probe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``thinwire probe``'s options."""
    parser.add_argument("--out", default="links.json", help="where rank 0 writes the probe")
    parser.add_argument(
        "--ranks-per-host",
        type=int,
        default=None,
        help="ranks on each host (default: torchrun's LOCAL_WORLD_SIZE)",
    )
    parser.add_argument(
        "--target-s",
        type=float,
        default=0.25,
        help="grow message sizes until one takes this long (default 0.25 s)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="repeats per size (default 3)")


def run_from_args(args: argparse.Namespace) -> int:
    """Join the job torchrun (or ``thinwire cluster run``) started, probe, save, print."""
    import torch.distributed as dist

    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        print(
            f"thinwire probe: error: no distributed job here ({', '.join(missing)} unset): run "
            "it on every rank, 'torchrun --nnodes N --nproc-per-node K ... -m thinwire.cli "
            "probe' or 'thinwire cluster run -- thinwire probe'",
            file=sys.stderr,
        )
        return 2
    per_host = args.ranks_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    try:
        probe = run_probe(per_host, target_s=args.target_s, repeats=args.repeats)
    except ValueError as error:
        print(f"thinwire probe: error: {error}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        probe.save(args.out)
        Console(width=120).print(probe_table(probe))
        print(
            f"saved to {args.out}: predict plans on these links with "
            f"'python bench/predict_hybrid.py --links {args.out} --results RESULTS.json'"
        )
    return 0


def probe_table(probe: LinkProbe) -> Table:
    """The probe's fits, one row per level and concurrency."""
    table = Table(title=f"links of {probe.hosts} host(s) x {probe.ranks_per_host} rank(s)")
    for column in ("level", "what", "at once", "latency", "bandwidth", "socket buffer"):
        table.add_column(column)
    for p2p in probe.point_to_point:
        table.add_row(
            "between hosts", "point to point", f"{p2p.pairs} pair(s)",
            f"{p2p.latency_s * 1e3:.2f} ms", format_rate(8 / p2p.beta_s),
            f"{p2p.buffer_bytes / 1e3:.0f} kB",
        )  # fmt: skip
    for level, fits, unit in (
        ("within a host", probe.intra_allreduce, "group(s) per host"),
        ("between hosts", probe.inter_allreduce, "group(s)"),
    ):
        for key, fit in fits.items():
            what = f"all-reduce, {key} ranks" if unit.startswith("group(s) per") else "all-reduce"
            table.add_row(
                level, what, "all" if unit.startswith("group(s) per") else f"{key} {unit}",
                f"{fit.alpha_s * 1e3:.3f} ms/step", format_rate(fit.bandwidth_bps), "",
            )  # fmt: skip
    table.add_row("CPU", "optimizer step", "every rank", f"{probe.cpu_slowdown:.2f}x alone", "", "")
    for ranks, slowdown in probe.cpu_slowdowns[1:-1]:  # the curve between alone and all
        table.add_row("CPU", "optimizer step", f"{ranks} ranks", f"{slowdown:.2f}x alone", "", "")
    return table
