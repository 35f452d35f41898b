"""The ``thinwire`` command line."""

from __future__ import annotations

import argparse
import contextlib
import signal
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def _compressors(args: argparse.Namespace) -> int:
    import dataclasses

    import thinwire
    from thinwire.compress.registry import compressor_class

    table = Table(title="thinwire compressors")
    table.add_column("name")
    table.add_column("aggregation")
    table.add_column("options")
    table.add_column("summary")
    for name, summary in thinwire.compressors().items():
        cls = compressor_class(name)
        options = (
            ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls))
            if dataclasses.is_dataclass(cls)
            else ""
        )
        table.add_row(name, cls.aggregation.value, options, summary)
    Console().print(table)
    return 0


def _strategies(args: argparse.Namespace) -> int:
    from thinwire.strategies import strategies, strategy

    table = Table(title="thinwire strategies (thinwire bench --methods, thinwire plan)")
    for column in ("name", "options", "costed as", "schedule", "summary"):
        table.add_column(column)
    for name, summary in strategies().items():
        chosen = strategy(name)
        options = ", ".join(f"{k}={v!r}" for k, v in chosen.options().items())
        table.add_row(name, options, chosen.costing, chosen.schedule, summary)
    Console(width=160).print(table)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from thinwire.demo import run_demo

    return run_demo(args)


def _cluster(args: argparse.Namespace) -> int:
    from thinwire.cluster import ClusterError, EmulatedCluster, list_namespaces
    from thinwire.cluster.faults import FaultError

    console = Console()
    try:
        if args.action == "up":
            cluster = EmulatedCluster(
                args.hosts, args.bandwidth, args.latency, tag=args.tag,
                ranks_per_host=args.ranks_per_host, uplink_queue=args.uplink_queue,
            )  # fmt: skip
            cluster.up(daemon=True)
            queue = (
                f"uplink queues of {args.uplink_queue} packets"
                if args.uplink_queue
                else "uplink queues of 10 ms"
            )
            console.print(
                f"cluster [bold]{cluster.tag}[/] is up: {args.hosts} hosts "
                f"{', '.join(h.address for h in cluster.hosts)} of {args.ranks_per_host} "
                f"rank(s) each, {args.bandwidth} links, {args.latency} one-way latency, {queue}, "
                f"MTU {cluster.mtu}.\nRun every rank: thinwire cluster run -- python train.py; "
                "stop it: thinwire cluster down"
            )
        elif args.action == "run":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                raise ClusterError("nothing to run: thinwire cluster run -- CMD [ARGS...]")
            codes = EmulatedCluster.attach(args.tag).run(command, port=args.port)
            console.print(f"exit codes by rank: {codes}")
            worst = max(codes, key=abs)
            return 128 - worst if worst < 0 else worst  # killed by signal N: 128 + N
        elif args.action == "fault":
            EmulatedCluster.attach(args.tag).fault(
                args.host, down=args.down, loss=args.loss, rate=args.rate, clear=args.clear
            )
            console.print(f"host {args.host}: fault applied")
        elif args.action == "down":
            EmulatedCluster.attach(args.tag).down()
            console.print("cluster removed")
        else:
            console.print(f"thinwire namespaces: {', '.join(list_namespaces()) or 'none'}")
            with contextlib.suppress(ClusterError):
                console.print(EmulatedCluster.attach(args.tag).describe())
    except (ClusterError, FaultError, ValueError) as error:
        console.print(f"[red]error:[/] {escape(str(error))}")
        return 2
    return 0


def _probe(args: argparse.Namespace) -> int:
    from thinwire.plan.probe_command import run_from_args

    return run_from_args(args)


def _bench(args: argparse.Namespace) -> int:
    from thinwire.bench.command import run_from_args

    return run_from_args(args)


def _plan(args: argparse.Namespace) -> int:
    import sys

    from thinwire.plan import report

    if args.model:
        from thinwire.plan.hybrid_command import run_from_args

        return run_from_args(args)
    missing = [f"--{n}" for n in ("task", "workers", "bandwidth") if getattr(args, n) in ("", None)]
    if missing:
        print(
            f"thinwire plan: error: {', '.join(missing)} missing: plan data parallelism with "
            "--task, --workers and --bandwidth, or a hybrid plan with --model (thinwire plan -h)",
            file=sys.stderr,
        )
        return 2
    try:
        request = report.parse_request(
            args.task,
            args.workers,
            args.bandwidth,
            args.latency,
            args.methods,
            args.options,
            bucket_cap_mb=args.bucket_cap_mb,
            broadcast_buffers=not args.no_broadcast_buffers,
            task_options=args.task_options,
        )
    except (ValueError, TypeError) as error:
        print(f"thinwire plan: error: {error}", file=sys.stderr)
        return 2
    if args.json and Path(args.json).is_dir():  # found before the plan's minutes, not after
        print(
            f"thinwire plan: error: --json {args.json} is a directory; give the file to "
            "write, e.g. runs/plan.json",
            file=sys.stderr,
        )
        return 2
    try:
        profile, rows = report.run_plan(request)
    except (ValueError, TypeError, OSError) as error:  # e.g. a task option, missing data
        print(f"thinwire plan: error: {error}", file=sys.stderr)
        return 2
    console = Console() if sys.stdout.isatty() else Console(width=150)  # full table in logs
    console.print(report.plan_table(rows, report.plan_title(request)))
    if args.json:
        report.write_json(report.plan_json(request, profile, rows), args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``thinwire`` command."""
    parser = argparse.ArgumentParser(
        prog="thinwire", description="Fast distributed PyTorch training on cheap networks."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("compressors", help="list the compressors and their options")
    listing.set_defaults(run=_compressors)
    listing = sub.add_parser(
        "strategies", help="list the training strategies (the methods bench and plan take)"
    )
    listing.set_defaults(run=_strategies)
    from thinwire.bench.command import add_ddp_arguments
    from thinwire.demo import add_demo_arguments

    demo = sub.add_parser("demo", help="a quick bench on an emulated cluster (make demo)")
    add_demo_arguments(demo)
    demo.set_defaults(run=_demo)
    plan = sub.add_parser(
        "plan",
        help="predict step time per method (--task), or choose a hybrid plan (--model)",
    )
    plan.add_argument("--task", default="", help="task name, e.g. digits, fashion, text")
    plan.add_argument("--workers", type=int, default=None, help="data-parallel workers")
    plan.add_argument("--bandwidth", default="", help="per-worker link, e.g. 100mbit")
    plan.add_argument("--latency", default="0", help="one-way latency, e.g. 1ms (default 0)")
    plan.add_argument("--methods", default="", help="comma-separated methods (default: a mix)")
    plan.add_argument("--options", default="", help='JSON, e.g. \'{"dgc": {"density": 0.01}}\'')
    plan.add_argument("--task-options", default="", help="JSON, e.g. '{\"batch_size\": 64}'")
    add_ddp_arguments(plan)
    plan.add_argument("--json", default="", help="also write the plan to this JSON file")
    from thinwire.plan.hybrid_command import add_arguments as add_hybrid_arguments

    add_hybrid_arguments(plan)
    plan.set_defaults(run=_plan)
    from thinwire.plan.probe_command import add_arguments as add_probe_arguments

    probe = sub.add_parser(
        "probe", help="measure the cluster's links on every rank (torchrun, cluster run)"
    )
    add_probe_arguments(probe)
    probe.set_defaults(run=_probe)
    from thinwire.bench.command import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="one task under several methods on an emulated cluster")
    add_bench_arguments(bench)
    bench.set_defaults(run=_bench)
    cluster = sub.add_parser(
        "cluster", help="an emulated cluster: hosts in network namespaces, slow links (root)"
    )
    actions = cluster.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="create the hosts and links; they stay until 'down'")
    up.add_argument("--hosts", type=int, default=4, help="hosts (default 4)")
    up.add_argument("--bandwidth", default="100mbit", help="per link, e.g. 10mbit, 1gbit")
    up.add_argument("--latency", default="1ms", help="one-way delay between any two hosts")
    up.add_argument(
        "--ranks-per-host",
        type=int,
        default=1,
        help="processes per host, sharing its loopback (default 1)",
    )
    up.add_argument(
        "--uplink-queue",
        type=int,
        default=None,
        help="packets each host's uplink queue holds (default: 10 ms of the link, 8 packets "
        "at 10 Mbit/s, where several bulk flows a way drop; 64 keeps them)",
    )
    run = actions.add_parser("run", help="run CMD as every rank: thinwire cluster run -- CMD")
    run.add_argument("--port", type=int, default=29500, help="MASTER_PORT (default 29500)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    fault = actions.add_parser("fault", help="break a host's link while the cluster runs")
    fault.add_argument("--host", type=int, required=True, help="which host (0 ..)")
    fault.add_argument("--down", default=None, help="drop every packet for this long, e.g. 5s")
    fault.add_argument("--loss", type=float, default=None, help="share of packets lost, e.g. 0.01")
    fault.add_argument("--rate", default=None, help="another downlink rate, e.g. 10mbit")
    fault.add_argument("--clear", action="store_true", help="undo the host's faults")
    actions.add_parser("down", help="remove the cluster")
    actions.add_parser("status", help="show the cluster and thinwire's namespaces")
    for action in actions.choices.values():
        action.add_argument("--tag", default=None, help="cluster name (default: the only one)")
        action.set_defaults(run=_cluster)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``thinwire`` command."""
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return args.run(args)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (a supervisor, ``timeout``, ``kill``) unwinds like Ctrl-C: every context
    manager runs, so worker processes stop and emulated hosts are removed."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    raise SystemExit(main())
