"""The planner's demo (part of ``make demo``): plan a GPT for 2 emulated hosts of 4 ranks,
then run the chosen plan beside the runner-up and pure data parallelism, each with its
prediction beside its measurement.

1. the emulated cluster comes up (2 hosts x 4 ranks, 100 Mbit/s and 1 ms between hosts)
   and ``thinwire probe`` measures its links from its 8 ranks;
2. the planner profiles the model's parts on this machine and searches every plan on
   those links (:func:`thinwire.plan.hybrid_command.plan_for`) and explains its choice;
3. the three plans run on the same ranks, on virtual accelerators (``--compute sleep``:
   each stage sleeps the compute it measured; communication is real), a few steps each,
   timed after the first ``untimed_steps`` (the planner predicts the steady state).

The probe and the profiles come before the runs; nothing measured in step 3 feeds step 2.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from thinwire.bench.hybrid import HybridConfig, time_on_sleeping_ranks
from thinwire.cluster import EmulatedCluster
from thinwire.launch import LocalPool, Placement
from thinwire.parallel.plan_spec import parse_plan

#: the demo's model: the ``gpt`` task at 27 M parameters, as the sweeps in docs/ use it
DEMO_MODEL = {"dim": 512, "layers": 8, "heads": 8, "seq_len": 128, "batch_size": 32}


def _probe_rank(rank: int, world: int, ranks_per_host: int) -> Any:
    from thinwire.plan.probe import run_probe

    return run_probe(ranks_per_host, target_s=0.2, repeats=3)


def run_plan_demo(
    out: Path,
    *,
    hosts: int = 2,
    ranks_per_host: int = 4,
    bandwidth: str = "100mbit",
    latency: str = "1ms",
    steps: int = 5,
    untimed_steps: int = 3,
    model: dict[str, Any] | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Probe, plan, run the three plans; print and write ``out/plan-demo.json``."""
    from thinwire.plan.explain import choice_changes, explain_text
    from thinwire.plan.hybrid_command import plan_for
    from thinwire.plan.model_source import ModelSource
    from thinwire.plan.search import SearchSpace

    console = console or Console()
    options = dict(model or DEMO_MODEL)
    out.mkdir(parents=True, exist_ok=True)
    world = hosts * ranks_per_host
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(
            EmulatedCluster(hosts, bandwidth, latency, ranks_per_host=ranks_per_host)
        )
        pool = stack.enter_context(
            LocalPool(world, collective_timeout_s=300, placement=Placement.on(cluster))
        )
        console.print(f"probing the links of {hosts} hosts x {ranks_per_host} ranks")
        probe = pool.run(_probe_rank, ranks_per_host)[0]
        probe.save(out / "links.json")
        console.print("profiling the model's parts and searching every plan")
        result, costs = plan_for(
            ModelSource("gpt", options), probe, None, SearchSpace(), log=console.print
        )
        links = f"measured by thinwire probe ({out / 'links.json'})"
        console.print(explain_text(result, costs, probe, links, choice_changes(result, probe)))
        chosen, runner_up = result.ranked[0], result.ranked[1]
        dense = f"{world}x1x1/mb1/1f1b"
        predicted = {e.label: e.prediction.step_s for e in result.ranked}
        labels = [chosen.label, runner_up.label, dense]
        config = HybridConfig(
            task="gpt", plans=tuple(parse_plan(label) for label in labels), steps=steps,
            task_options=options, network="emulated", ranks_per_host=ranks_per_host,
            bandwidth=bandwidth, latency=latency, compute="sleep", untimed_steps=untimed_steps,
        )  # fmt: skip
        rows = []
        for role, label, plan in zip(
            ("chosen", "runner-up", "pure data parallel"), labels, config.plans, strict=True
        ):
            record = time_on_sleeping_ranks(pool, config, plan, console.print)
            rows.append(
                {
                    "role": role,
                    "plan": label,
                    "predicted_s": predicted[label],
                    "measured_s": record["step_s"],
                }
            )
    table = Table(title=f"the planner's choice on {hosts} x {ranks_per_host} at {bandwidth}")
    for column in ("plan", "", "predicted s/step", "measured s/step", "predicted/measured"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["plan"],
            row["role"],
            f"{row['predicted_s']:.2f}",
            f"{row['measured_s']:.2f}",
            f"{row['predicted_s'] / row['measured_s']:.2f}",
        )
    console.print(table)
    summary = {"model": options, "bandwidth": bandwidth, "rows": rows}
    (out / "plan-demo.json").write_text(json.dumps(summary, indent=1))
    return summary
