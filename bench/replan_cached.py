"""Plan again from the compute profiles ``thinwire plan --cache`` kept, measuring only the
named methods' exchanges anew: what a change to how those exchanges are profiled does to
the predictions, with the machine's drift between two compute profiles left out.

    python bench/replan_cached.py --cache runs/plan-profiles \\
        --model-options '{"dim": 512, "layers": 8, "heads": 8, "seq_len": 128, "batch_size": 32}' \\
        --remeasure dense,powersgd,dgc \\
        docs/results/links-2x4-1gbit-b2b.json=plan-1gbit.json [PROBE=JSON ...]

The cache's files are read whatever the thinwire version that wrote them (each holds its
key and its profiles); those of the task ``gpt`` (or ``--model``) with these options are
merged, one per tensor-parallel degree (the newest of each); the exchanges are measured
once, then the model is planned on each probe. The JSON is ``thinwire plan --json``'s. On this
two-core machine a compute profile taken hours apart differs by up to 10 % (the cores'
speed drifts), more than many of the model changes it is used to judge.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

from thinwire.plan.explain import choice_changes, explain_json
from thinwire.plan.hybrid_command import parse_methods
from thinwire.plan.model_costs import ModelCosts, measure_exchanges
from thinwire.plan.probe import LinkProbe
from thinwire.plan.search import SearchSpace, search


def cached_costs(cache: Path, model: str, options: dict) -> ModelCosts:
    """The cached profiles of ``model`` with ``options``, merged over their ``tp``."""
    merged: ModelCosts | None = None
    seen: set[int] = set()
    for path in sorted(cache.glob("*.pkl"), key=lambda p: p.stat().st_mtime, reverse=True):
        key, costs = pickle.loads(path.read_bytes())
        name, kept_options, *_ = json.loads(key)
        tps = {tp for tp, _ in costs.compute} | set(costs.refused)
        if name != model or kept_options != options or not tps or tps & seen:
            continue  # another model, or an older profile of a tp already taken
        seen |= tps
        if merged is None:
            merged = costs
        else:
            merged.merge(costs)
    if merged is None:
        raise SystemExit(f"{cache} holds no profile of {model} with {options}")
    return merged


def remeasure(costs: ModelCosts, methods: set[str]) -> int:
    """Measure the exchanges of ``methods`` again on the cached parts; returns how many."""
    count = 0
    for tp, dp, label in list(costs.exchange):
        ((name, options),) = parse_methods(label)
        if name not in methods:
            continue
        size = max(s for t, s in costs.compute if t == tp)
        costs.exchange[(tp, dp, label)] = measure_exchanges(
            costs.compute[(tp, size)], dp, (name, options), 1
        )
        count += 1
    return count


def main() -> None:
    """Re-plan on each probe and write the JSONs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--model-options", default="{}")
    parser.add_argument("--remeasure", default="", help="comma-separated method names")
    parser.add_argument("plans", nargs="+", metavar="PROBE=JSON")
    args = parser.parse_args()
    pairs = [tuple(item.split("=", 1)) for item in args.plans]
    if any(len(pair) != 2 for pair in pairs):
        parser.error("each plan is PROBE=JSON: the probe file and the JSON to write")
    costs = cached_costs(args.cache, args.model, json.loads(args.model_options))
    count = remeasure(costs, {m for m in args.remeasure.split(",") if m})
    print(f"{count} exchanges measured again")
    for probe_path, out in pairs:
        probe = LinkProbe.load(probe_path)
        result = search(costs, probe, None, SearchSpace())
        changes = choice_changes(result, probe)
        links = f"measured by thinwire probe ({probe_path})"
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(explain_json(result, costs, probe, links, changes), indent=1))
        best = result.ranked[0]
        print(f"{probe_path}: chosen {best.label}, {best.prediction.step_s:.3f} s -> {out}")


if __name__ == "__main__":
    sys.exit(main())
