"""Kill -9 one rank mid-run under ``torchrun --max-restarts``; check the job resumes exactly.

    python bench/restart_drill.py --methods dgc powersgd delayed ps --repeats 5 \
        --out docs/results/restart-drill.json

Runs ``examples/restartable.py`` on 4 emulated hosts (network namespaces, one ``torchrun``
agent per host joined by c10d rendezvous over the emulated links; ``--local``: one
``torchrun`` on this machine instead, no root needed). For each method: one uninterrupted
run, then ``--repeats`` runs in which one rank chosen at random is killed with SIGKILL when
it reaches a random step. Each run must exit 0 on every host, and its final weights must
equal the uninterrupted run's bit for bit. Writes every run's outcome as JSON; the cluster's
namespaces are removed afterwards, whatever failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "restartable.py"
METHODS = ("dgc", "powersgd", "delayed", "ps")


def agent_commands(
    args: argparse.Namespace, work: Path, run_id: str, port: int, cluster: Any
) -> list[tuple[list[str], dict[str, str]]]:
    """One ``torchrun`` per host (or one for all ranks with ``--local``): argv and env."""
    script = [
        str(SCRIPT), "--method", args.method, "--steps", str(args.steps),
        "--every", str(args.every), "--checkpoints", str(work / "ckpt"),
        "--out", str(work / "final.pt"), "--progress", str(work / "progress"),
    ]  # fmt: skip
    run = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "3",
           "--monitor-interval", "0.5"]  # fmt: skip
    # torchrun's workers otherwise share its rendezvous store, where a restarted job can
    # read the address of a worker of the attempt before (pytorch/pytorch#167288)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT / "src"),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    if cluster is None:
        command = [*run, "--standalone", "--nproc-per-node", str(args.ranks), *script]
        return [(command, env)]
    commands = []
    for host in cluster.hosts:
        rendezvous = [
            "--nnodes", str(len(cluster.hosts)), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-id", run_id,
            "--rdzv-endpoint", f"{cluster.master_address}:{port}",
            "--rdzv-conf", f"is_host={int(host.rank == 0)},read_timeout=300",
            "--local-addr", host.address,
        ]  # fmt: skip
        host_env = {**env, "GLOO_SOCKET_IFNAME": host.interface}
        commands.append((["ip", "netns", "exec", host.namespace, *run, *rendezvous, *script],
                         host_env))  # fmt: skip
    return commands


def read_progress(folder: Path) -> dict[int, dict[str, int]]:
    """Each rank's last written pid, step and restart count."""
    found = {}
    for path in folder.glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            found[int(path.stem[4:])] = json.loads(path.read_text())
    return found


def stop_agents(agents: list[subprocess.Popen], work: Path) -> list[int]:
    """Wait for the agents; stop any still running (SIGTERM: torchrun stops its workers,
    then SIGKILL), and kill workers left behind (torchrun starts them in sessions of their
    own), found by this run's folder in their command line; the agents' exit codes."""
    for agent in agents:
        if agent.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGTERM)
    for agent in agents:
        try:
            agent.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
    subprocess.run(["pkill", "-9", "-f", f"{work}/ckpt"], check=False)
    return [agent.wait() for agent in agents]


@dataclass
class Trigger:
    """Something done once during a run: when rank ``rank`` of the first attempt reaches
    step ``step``, ``act`` is called with its progress (pid, step) and returns a record."""

    rank: int
    step: int
    act: Callable[[dict[str, int]], dict[str, Any]]


def kill_at(rank: int, step: int) -> Trigger:
    """SIGKILL rank ``rank`` when it reaches ``step``."""

    def kill(where: dict[str, int]) -> dict[str, Any]:
        os.kill(where["pid"], signal.SIGKILL)
        return {"rank": rank, "step": where["step"], "pid": where["pid"]}

    return Trigger(rank, step, kill)


def one_run(
    args: argparse.Namespace, cluster: Any, trigger: Trigger | None, index: int
) -> dict[str, Any]:
    """One job (with ``trigger`` pulled on the way, if given): its outcome."""
    with tempfile.TemporaryDirectory(prefix="thinwire-drill-") as folder:
        work = Path(folder)
        (work / "progress").mkdir()
        port = 20000 + (os.getpid() * 7 + index) % 20000
        commands = agent_commands(args, work, f"drill{os.getpid()}x{index}", port, cluster)
        logs = [open(work / f"agent{i}.log", "w") for i in range(len(commands))]  # noqa: SIM115
        began = time.monotonic()
        agents = [
            subprocess.Popen(c, env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            for (c, e), log in zip(commands, logs, strict=True)
        ]
        event: dict[str, Any] | None = None
        timed_out = False
        try:
            while any(a.poll() is None for a in agents):
                if time.monotonic() - began > args.timeout:
                    timed_out = True
                    break
                if trigger is not None and event is None:
                    where = read_progress(work / "progress").get(trigger.rank)
                    if where and where["restarts"] == 0 and where["step"] >= trigger.step:
                        event = {"at": time.time(), **trigger.act(where)}
                time.sleep(0.01)
        finally:
            codes = stop_agents(agents, work)
            for log in logs:
                log.close()
        wall_s = time.monotonic() - began
        outcome: dict[str, Any] = {
            "exit_codes": codes,
            "timed_out": timed_out,
            "wall_s": round(wall_s, 1),
            "target": None if trigger is None else {"rank": trigger.rank, "step": trigger.step},
            "event": event,
        }
        final = work / "final.pt"
        if final.exists():
            saved = torch.load(final, weights_only=False)
            outcome["weights"] = saved["weights"]
            outcome["resumed_at"] = saved["resumed_at"]
        logs = [(work / f"agent{i}.log").read_text() for i in range(len(commands))]
        outcome["starts"] = [  # rank 0 prints where each attempt starts
            int(line.rsplit(" ", 1)[1])
            for log in logs
            for line in log.splitlines()
            if "resuming at step" in line
        ]
        outcome["failures"] = [  # what each rank raised, and when (examples/restartable.py)
            {"rank": int(m[1]), "at": float(m[2]), "error": m[3][:200]}
            for log in logs
            for m in re.finditer(r"rank (\d+) failed at ([\d.]+): (.*)", log)
        ]
        if any(codes) or timed_out or not final.exists():
            outcome["log_tail"] = [log[-3000:] for log in logs]
        return outcome


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two state dicts hold the same tensors bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def drill(args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    """Every method: a reference run, then the killed runs; the results."""
    rng = random.Random(args.seed)
    results: dict[str, Any] = {}
    index = 0
    for method in args.methods:
        args.method = method
        reference = one_run(args, cluster, None, index)
        index += 1
        runs = []
        print(f"{method}: reference exit {reference['exit_codes']} in {reference['wall_s']} s",
              flush=True)  # fmt: skip
        for repeat in range(args.repeats):
            target = kill_at(rng.randrange(args.ranks), rng.randrange(3, args.steps - 3))
            outcome = one_run(args, cluster, target, index)
            index += 1
            exact = "weights" in outcome and "weights" in reference
            outcome["bit_exact"] = exact and same_weights(outcome["weights"], reference["weights"])
            outcome["finished"] = not any(outcome["exit_codes"]) and "weights" in outcome
            print(f"{method} {repeat + 1}/{args.repeats}: killed {outcome['event']}, "
                  f"attempts started at steps {outcome.get('starts')}, "
                  f"exit {outcome['exit_codes']}, bit-exact {outcome['bit_exact']}, "
                  f"{outcome['wall_s']} s", flush=True)  # fmt: skip
            outcome.pop("weights", None)
            runs.append(outcome)
        reference.pop("weights", None)
        results[method] = {
            "reference": reference,
            "runs": runs,
            "finished": sum(r["finished"] for r in runs),
            "bit_exact": sum(r["bit_exact"] for r in runs),
        }
    return results


def main() -> None:
    """Parse arguments, bring the cluster up (unless ``--local``), drill, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--ranks", type=int, default=4, help="hosts (one rank each)")
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--latency", default="1ms")
    parser.add_argument("--local", action="store_true", help="no namespaces: one torchrun here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--out", default="runs/restart-drill.json")
    args = parser.parse_args()
    began = time.monotonic()
    if args.local:
        results = drill(args, None)
        left: list[str] = []
    else:
        from thinwire.cluster import EmulatedCluster, list_namespaces

        with EmulatedCluster(args.ranks, bandwidth=args.bandwidth, latency=args.latency) as c:
            results = drill(args, c)
            tag = c.tag
        left = [n for n in list_namespaces() if f"-{tag}-" in n]
    summary = {
        "command": " ".join(["python", "bench/restart_drill.py", *sys.argv[1:]]),
        "setup": "local"
        if args.local
        else f"{args.ranks} emulated hosts, {args.bandwidth} {args.latency}",
        "steps": args.steps,
        "checkpoint_every": args.every,
        "wall_s": round(time.monotonic() - began, 1),
        "namespaces_left": left,
        "methods": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    for method, result in results.items():
        print(f"{method}: {result['finished']}/{args.repeats} finished, "
              f"{result['bit_exact']}/{args.repeats} bit-exact")  # fmt: skip
    print(f"namespaces left: {left or 'none'}")


if __name__ == "__main__":
    main()
