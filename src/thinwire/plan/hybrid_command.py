"""``thinwire plan --model ...``: choose a hybrid plan for a model on a cluster, and say why.

    thinwire plan --model gpt --hosts 2 --ranks-per-host 4 --bandwidth 100mbit --memory 8GiB
    thinwire plan --model gpt --probe links.json --json runs/plan.json
    thinwire plan --model mypackage.models:build --batch-size 32 --seq-len 512 --probe ...

The model is profiled part by part (:mod:`thinwire.plan.model_costs`, cached under
``--cache``), the links are a probe's (``thinwire probe``) or nominal (``--bandwidth``,
``--latency``), and the search (:mod:`thinwire.plan.search`) ranks every plan.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from thinwire.cluster.units import parse_bytes, parse_duration, parse_rate
from thinwire.parallel.plan_spec import parse_options
from thinwire.plan.model_costs import Method, ModelCosts, profile_model
from thinwire.plan.model_source import ModelSource
from thinwire.plan.nominal_links import nominal_probe
from thinwire.plan.probe import LinkProbe
from thinwire.plan.schedule_sim import SIMULATED_SCHEDULES
from thinwire.plan.search import SearchResult, SearchSpace, needs, search, shapes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The hybrid planner's options of ``thinwire plan``."""
    group = parser.add_argument_group("hybrid plans (--model)")
    group.add_argument("--model", default="", help="task (gpt) or module:function returning it")
    group.add_argument("--model-options", default="", help='JSON, e.g. \'{"style": "llama"}\'')
    group.add_argument("--batch-size", type=int, default=None, help="global batch (sequences)")
    group.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    group.add_argument("--hosts", type=int, default=None, help="hosts (with --bandwidth)")
    group.add_argument("--ranks-per-host", type=int, default=None, help="ranks on each host")
    group.add_argument("--probe", default="", help="links measured by 'thinwire probe --out'")
    group.add_argument("--intra-bandwidth", default="10gbit", help="within a host (nominal)")
    group.add_argument("--intra-latency", default="50us", help="within a host (nominal)")
    group.add_argument("--memory", default="", help="limit per rank, e.g. 8GiB (default none)")
    group.add_argument("--microbatches", default="1,2,4,8", help="micro-batch counts to try")
    group.add_argument(
        "--schedules",
        default=",".join(SearchSpace().schedules),
        help="pipeline schedules to try (shifted-1f1b only where a plan recomputes)",
    )
    group.add_argument(
        "--subbatches",
        default="1,2",
        help="sub-batches per micro-batch to try for tp > 1 (all-reduces overlapping compute)",
    )
    group.add_argument(
        "--dp-methods",
        default="dense;powersgd(rank=4);dgc(density=0.01,momentum=0.0)",
        help="data-parallel methods to try, ';'-separated",
    )
    group.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    group.add_argument("--repeats", type=int, default=3, help="timed repeats per part")
    group.add_argument("--cache", default="runs/plan-profiles", help="profiles kept here")
    group.add_argument("--top", type=int, default=5, help="runners-up and rejections shown")


def parse_methods(text: str) -> tuple[Method, ...]:
    """``dense;powersgd(rank=4);dgc`` as (name, options) pairs."""
    methods = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, rest = item.partition("(")
        if rest and not rest.endswith(")"):
            raise ValueError(f"--dp-methods: {item!r} is not NAME or NAME(key=value,...)")
        methods.append((name.strip(), parse_options(rest[:-1], item) if rest else {}))
    if not methods:
        raise ValueError("--dp-methods names no method; e.g. 'dense;powersgd(rank=4)'")
    from thinwire.parallel.plan import ParallelPlan

    for name, options in methods:  # each is checked as a plan would check it
        ParallelPlan(dp=2, dp_method=name, dp_options=options)
    return tuple(methods)


def _numbers(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"--{what} must list integers >= 1, e.g. 1,2,4,8; got {text!r}")
    return values


def links_of(args: argparse.Namespace) -> tuple[LinkProbe, str]:
    """The probe the arguments name, or nominal links; and a line describing them."""
    if args.probe:
        probe = LinkProbe.load(args.probe)
        for name, given in (("hosts", args.hosts), ("ranks_per_host", args.ranks_per_host)):
            if given is not None and given != getattr(probe, name):
                raise ValueError(
                    f"--{name.replace('_', '-')} {given} but the probe {args.probe} measured "
                    f"{getattr(probe, name)}: drop the option, or probe the cluster you plan"
                )
        return probe, f"measured by thinwire probe ({args.probe})"
    if not args.bandwidth or args.hosts is None or args.ranks_per_host is None:
        raise ValueError(
            "say what the cluster is: --probe FILE (from 'thinwire probe'), or --hosts, "
            "--ranks-per-host and --bandwidth (and --latency) for nominal links"
        )
    bandwidth = parse_rate(args.bandwidth)
    intra = parse_rate(args.intra_bandwidth)
    if bandwidth is None or intra is None:
        raise ValueError("--bandwidth and --intra-bandwidth need a finite rate, e.g. 100mbit")
    latency = parse_duration(args.latency)
    probe = nominal_probe(
        args.hosts, args.ranks_per_host, bandwidth, latency, intra,
        parse_duration(args.intra_latency),
    )  # fmt: skip
    return probe, (
        f"nominal: {args.bandwidth} and {args.latency} between hosts, {args.intra_bandwidth} "
        f"and {args.intra_latency} within a host (measure them: thinwire probe)"
    )


def plan_for(
    source: ModelSource, probe: LinkProbe, memory_limit: int | None, space: SearchSpace,
    *, repeats: int = 3, optimizer: str = "adamw", cache: Path | None = None, log: Any = None,
) -> tuple[SearchResult, ModelCosts]:  # fmt: skip
    """Profile what the search needs of ``source`` on ``probe``'s cluster, then search."""
    world = probe.hosts * probe.ranks_per_host
    batch = source.batch()
    blocks = _blocks(source)
    found, _ = shapes(world, probe.ranks_per_host, blocks, batch, space)
    if not found:
        raise ValueError(
            f"no plan of {world} ranks splits a batch of {batch} for {blocks} blocks: use a "
            f"global batch that is a multiple of {world}"
        )
    costs = profile_model(
        source, needs(found, batch), repeats=repeats, optimizer=optimizer, cache=cache, log=log
    )
    return search(costs, probe, memory_limit, space), costs


def _blocks(source: ModelSource) -> int:
    """How many blocks the model has (built on the meta device: nothing allocated)."""
    import torch

    from thinwire.parallel.layout import read_layout, submodule

    if source.live is not None:  # already built: unpickled as it is
        model = source.build_model()
    else:
        with torch.device("meta"):
            model = source.build_model()
    return len(submodule(model, read_layout(model).blocks))


def run_from_args(args: argparse.Namespace) -> int:
    """``thinwire plan --model ...``: profile, search, explain; 2 on a bad request."""
    from thinwire.plan.explain import choice_changes, explain_json, explain_text

    try:
        probe, links = links_of(args)
        options = json.loads(args.model_options) if args.model_options else {}
        if not isinstance(options, dict):
            raise ValueError(f"--model-options must be a JSON object, got {args.model_options}")
        source = ModelSource(args.model, options, args.batch_size, args.seq_len)
        memory = parse_bytes(args.memory) if args.memory else None
        space = SearchSpace(
            microbatches=_numbers(args.microbatches, "microbatches"),
            schedules=tuple(s.strip() for s in args.schedules.split(",") if s.strip()),
            methods=parse_methods(args.dp_methods),
            subbatches=_numbers(args.subbatches, "subbatches"),
        )
        unknown = set(space.schedules) - set(SIMULATED_SCHEDULES)
        if unknown:
            raise ValueError(
                f"--schedules: the planner searches {', '.join(SIMULATED_SCHEDULES)}, not "
                f"{', '.join(sorted(unknown))}"
            )
        if args.json and Path(args.json).is_dir():
            raise ValueError(f"--json {args.json} is a directory; give the file to write")
        result, costs = plan_for(
            source, probe, memory, space, repeats=args.repeats, optimizer=args.optimizer,
            cache=Path(args.cache) if args.cache else None,
            log=lambda line: print(line, file=sys.stderr),
        )  # fmt: skip
    except (ValueError, TypeError, OSError, json.JSONDecodeError) as error:
        print(f"thinwire plan: error: {error}", file=sys.stderr)
        return 2
    changes = choice_changes(result, probe)
    print(explain_text(result, costs, probe, links, changes, top=args.top))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(explain_json(result, costs, probe, links, changes), indent=1))
    return 0 if result.ranked else 1
