"""Training through link faults on 4 emulated hosts: outages, loss, and the restart after.

    python bench/link_faults.py --out docs/results/link-faults.json

Runs ``examples/restartable.py`` (DGC through the DDP hook, a checkpoint every 10 steps,
process-group timeout 60 s) under ``torchrun --max-restarts 3`` on 4 emulated hosts, as
``bench/restart_drill.py`` does, in four ways:

- ``clean``: no fault (the reference: wall time and final weights);
- ``down-short``: host 1's link down for ``--short`` seconds (5) when rank 1 reaches step
  40: the job should ride through, ending on the reference's weights;
- ``down-long``: host 1's link down for ``--long`` seconds (90, beyond the 60 s timeout):
  every rank should raise within timeout + 10 s of the outage, torchrun restarts the job,
  which resumes from the last checkpoint once the link is back, ending on the reference's
  weights;
- ``loss``: 1 % of every host's packets lost from the start: the job should finish; its
  slowdown against ``clean`` is reported.

The cluster's namespaces are removed afterwards, whatever failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from restart_drill import Trigger, one_run, same_weights
from thinwire.cluster import EmulatedCluster, list_namespaces

TIMEOUT_S = 60.0  # examples/restartable.py's process-group timeout


def outage(cluster: EmulatedCluster, host: int, seconds: float) -> Trigger:
    """Take ``host``'s link down for ``seconds`` when rank ``host`` reaches step 40."""

    def down(where: dict[str, int]) -> dict[str, Any]:
        cluster.fault(host, down=seconds)
        return {"host": host, "down_s": seconds, "step": where["step"]}

    return Trigger(host, 40, down)


def summarise(name: str, outcome: dict[str, Any], clean: dict[str, Any]) -> dict[str, Any]:
    """The figures the issue asks for, from one run's outcome."""
    summary: dict[str, Any] = {
        "finished": not any(outcome["exit_codes"]) and "weights" in outcome,
        "exit_codes": outcome["exit_codes"],
        "wall_s": outcome["wall_s"],
        "slowdown": round(outcome["wall_s"] / clean["wall_s"], 2),
        "starts": outcome["starts"],
        "event": outcome["event"],
    }
    if "weights" in outcome and "weights" in clean:
        summary["bit_exact"] = same_weights(outcome["weights"], clean["weights"])
    if outcome["event"] is not None and outcome["failures"]:
        began = outcome["event"]["at"]
        first = {}
        for failure in outcome["failures"]:
            first.setdefault(failure["rank"], failure)
        summary["raised_after_s"] = {r: round(f["at"] - began, 1) for r, f in sorted(first.items())}
        summary["errors"] = {r: f["error"][:120] for r, f in sorted(first.items())}
    if "log_tail" in outcome:
        summary["log_tail"] = outcome["log_tail"]
    print(f"{name}: {json.dumps({k: v for k, v in summary.items() if k != 'log_tail'})}")
    return summary


def main() -> None:
    """Bring the cluster up, run the four cases, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", type=float, default=5.0, help="seconds of the short outage")
    parser.add_argument("--long", type=float, default=90.0, help="seconds of the long outage")
    parser.add_argument("--loss", type=float, default=0.01, help="share of packets lost")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--latency", default="1ms")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--out", default="runs/link-faults.json")
    args = parser.parse_args()
    args.method, args.every, args.ranks = "dgc", 10, 4
    results: dict[str, Any] = {}
    began = time.monotonic()
    with EmulatedCluster(4, bandwidth=args.bandwidth, latency=args.latency) as cluster:
        clean = one_run(args, cluster, None, 0)
        results["clean"] = summarise("clean", clean, clean)
        short = one_run(args, cluster, outage(cluster, 1, args.short), 1)
        results["down-short"] = summarise("down-short", short, clean)
        long = one_run(args, cluster, outage(cluster, 1, args.long), 2)
        results["down-long"] = summarise("down-long", long, clean)
        for host in range(4):
            cluster.fault(host, loss=args.loss)
        lossy = one_run(args, cluster, None, 3)
        results["loss"] = summarise("loss", lossy, clean)
        tag = cluster.tag
    long_summary = results["down-long"]
    raised = long_summary.get("raised_after_s", {})
    verdict = {
        "short_outage_rode_through": results["down-short"]["finished"]
        and results["down-short"]["starts"] == [0],
        "long_outage_every_rank_raised_within_timeout_plus_10s": len(raised) == 4
        and max(raised.values()) <= TIMEOUT_S + 10,
        "long_outage_resumed_exactly": bool(long_summary.get("bit_exact")),
        "loss_finished": results["loss"]["finished"],
    }
    summary = {
        "command": " ".join(["python", "bench/link_faults.py", *sys.argv[1:]]),
        "setup": f"4 emulated hosts, {args.bandwidth} {args.latency}, DGC hook, "
        f"{args.steps} steps, checkpoint every 10, process-group timeout {TIMEOUT_S:.0f} s",
        "wall_s": round(time.monotonic() - began, 1),
        "verdict": verdict,
        "namespaces_left": [n for n in list_namespaces() if f"-{tag}-" in n],
        "runs": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(verdict, indent=2), f"\nnamespaces left: {summary['namespaces_left']}")


if __name__ == "__main__":
    main()
