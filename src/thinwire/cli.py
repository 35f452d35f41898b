"""The ``thinwire`` command line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
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


def _demo(args: argparse.Namespace) -> int:
    from thinwire.demo import DEFAULT_METHODS, run_demo

    methods = DEFAULT_METHODS
    if args.methods:
        methods = {}
        for name in args.methods.split(","):
            methods[name] = DEFAULT_METHODS.get(name, {})
    if args.options:
        for name, options in json.loads(args.options).items():
            methods[name] = options
    run_demo(workers=args.workers, steps=args.steps, methods=methods, out=Path(args.out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``thinwire`` command."""
    parser = argparse.ArgumentParser(
        prog="thinwire", description="Fast distributed PyTorch training on cheap networks."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("compressors", help="list the compressors and their options")
    listing.set_defaults(run=_compressors)
    demo = sub.add_parser("demo", help="train a real model on local processes, several methods")
    demo.add_argument("--workers", type=int, default=4, help="local processes (default 4)")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    demo.add_argument("--methods", default="", help="comma-separated methods (default: a mix)")
    demo.add_argument(
        "--options",
        default="",
        help='JSON of options per method, e.g. \'{"dgc": {"density": 0.01}}\'',
    )
    demo.add_argument("--out", default="results", help="directory for demo.json")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``thinwire`` command."""
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
