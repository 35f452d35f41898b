"""Plans written on the command line:
``DPxPPxTP[/mbN][/SCHEDULE][/stagesB,...][/rcR,...|/rcsaR][/sbN][:METHOD[(k=v,...)]]``.

    2x2x2                       dp=2 pp=2 tp=2, 2 micro-batches, 1F1B, dense dp
    2x2x2/mb4/gpipe:powersgd(rank=4)
    1x4x2/mb8/stages2,4,7       stages start at blocks 0, 2, 4 and 7 (default: even)
    8x1x1:dgc(density=0.01)
    1x4x2/mb8/rc1               every stage recomputes all its blocks
    1x4x2/mb8/rc1,0.5,0.5,0     a recomputation ratio per stage
    1x4x2/mb8/rcsa0.75          Merak's stage-aware ratios from the first stage's 0.75
    1x1x4/mb2/sb2               each micro-batch as 2 sub-batches in turns (tp all-reduces
                                overlapping compute)

Micro-batches default to ``pp`` (the fewest 1F1B accepts). Option values are read as
Python literals (numbers, booleans, strings).
"""

from __future__ import annotations

import ast
import re

from thinwire.parallel.plan import SCHEDULES, ParallelPlan
from thinwire.parallel.recompute import stage_aware_ratios

_PLAN = re.compile(
    r"^(?P<dp>\d+)x(?P<pp>\d+)x(?P<tp>\d+)"
    r"(?P<parts>(?:/[^/:]+)*)"
    r"(?::(?P<method>[\w-]+)(?:\((?P<options>[^)]*)\))?)?$"
)


def parse_options(text: str, spec: str) -> dict:
    """``key=value,...`` of plan ``spec``, values read as Python literals (else strings)."""
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"option {item!r} in plan {spec!r} is not key=value")
        try:
            options[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key.strip()] = value.strip()
    return options


def parse_plan(spec: str) -> ParallelPlan:
    """The :class:`ParallelPlan` ``spec`` writes (see the module's docstring)."""
    match = _PLAN.match(spec.strip())
    if match is None:
        raise ValueError(
            f"cannot read plan {spec!r}: write DPxPPxTP[/mbN][/SCHEDULE][/stagesB,...][/rcR][/sbN]"
            "[:METHOD(k=v,...)], "
            "e.g. 2x2x2/mb4/1f1b:powersgd(rank=4)"
        )
    dp, pp, tp = (int(match[name]) for name in ("dp", "pp", "tp"))
    microbatches, schedule, stages, recompute, subbatches = pp, "1f1b", None, None, 1
    number = r"\d+(?:\.\d*)?|\.\d+"
    for part in filter(None, match["parts"].split("/")):
        if part.startswith("mb") and part[2:].isdigit():
            microbatches = int(part[2:])
        elif part.startswith("stages") and re.fullmatch(r"\d+(,\d+)*", part[6:]):
            stages = tuple(int(b) for b in part[6:].split(","))
        elif part.startswith("sb") and part[2:].isdigit():
            subbatches = int(part[2:])
        elif part in SCHEDULES:
            schedule = part
        elif part.startswith("rcsa") and re.fullmatch(number, part[4:]):
            recompute = ("stage-aware", float(part[4:]))
        elif part.startswith("rc") and re.fullmatch(rf"(?:{number})(?:,(?:{number}))*", part[2:]):
            recompute = tuple(float(r) for r in part[2:].split(","))
        else:
            raise ValueError(
                f"plan {spec!r}: {part!r} is neither mbN (micro-batches), a schedule "
                f"({', '.join(SCHEDULES)}), stagesB,... (where stages start), rcR,... "
                "(recomputation ratios), rcsaR (stage-aware recomputation) nor sbN (sub-batches)"
            )
    method = match["method"] or "dense"
    options = parse_options(match["options"] or "", spec)
    chunks = ParallelPlan(pp=pp, microbatches=max(microbatches, pp), schedule=schedule).chunks
    if recompute and recompute[0] == "stage-aware":
        recompute = stage_aware_ratios(recompute[1], chunks)
    elif recompute and len(recompute) == 1:
        recompute = recompute * chunks
    return ParallelPlan(
        dp=dp, pp=pp, tp=tp, microbatches=microbatches, schedule=schedule, stages=stages,
        recompute=recompute, subbatches=subbatches, dp_method=method, dp_options=options,
    )  # fmt: skip


def parse_plans(text: str) -> list[ParallelPlan]:
    """Plans separated by spaces or semicolons (commas separate a method's options)."""
    specs = [s for s in re.split(r"[;\s]+", text.strip()) if s]
    if not specs:
        raise ValueError("--plans lists no plan; e.g. --plans '8x1x1 2x2x2:powersgd(rank=4)'")
    return [parse_plan(s) for s in specs]


def plan_label(plan: ParallelPlan) -> str:
    """The plan written back in the command line's form."""
    label = f"{plan.dp}x{plan.pp}x{plan.tp}/mb{plan.microbatches}/{plan.schedule}"
    if plan.stages:
        label += "/stages" + ",".join(map(str, plan.stages))
    if plan.recompute:
        label += "/rc" + ",".join(f"{r:g}" for r in plan.recompute)
    if plan.subbatches > 1:
        label += f"/sb{plan.subbatches}"
    if plan.dp_method != "dense":
        options = ",".join(f"{k}={v}" for k, v in sorted(plan.dp_options.items()))
        label += f":{plan.dp_method}" + (f"({options})" if options else "")
    return label
