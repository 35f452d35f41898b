"""Exit codes of the README's DDP quick start under ``torchrun``, beside plain DDP's.

    python bench/exit_codes.py --runs 50 --out docs/results/exit-codes.json

Runs ``examples/quickstart_ddp.py`` (thinwire's DGC hook, a checkpoint, then
``dist.destroy_process_group()``) ``--runs`` times with ``torchrun --nproc-per-node 2``,
and the same script with the hook taken out (plain DDP: the control), alternating, each in
a fresh directory on a free port; counts exit codes and keeps the output of every run that
did not exit 0 (an abort at exit shows as a signal, e.g. -6 or 134, or a torchrun failure).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from thinwire.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
QUICK_START = ROOT / "examples" / "quickstart_ddp.py"


def plain_ddp(source: str) -> str:
    """The quick start with thinwire's hook and its state taken out: DDP's own all-reduce."""
    text = re.sub(
        r"engine = thinwire\.register\(.*?\)  # DGC.*?\n", "", source, count=1, flags=re.S
    )
    text = re.sub(r"    if rank == 0 and step % 20 == 19:\n(?:        .*\n)+", "", text)
    text = text.replace('"thinwire": engine.full_state_dict()', '"thinwire": None').replace(
        'engine.load_state_dict(torch.load("quickstart-ckpt.pt")["thinwire"])', "pass"
    )
    text = text.replace("after {engine.step} steps", "")
    if "engine" in text.replace("engine = None", ""):
        raise RuntimeError("the quick start changed: update plain_ddp() to take thinwire out")
    return text


def run_once(script: Path, timeout_s: float) -> tuple[int, str, float]:
    """``torchrun --nproc-per-node 2 script`` in a fresh directory: exit code, output, time."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(script),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        try:
            done = subprocess.run(
                command, cwd=directory, env=env, capture_output=True, text=True, timeout=timeout_s
            )
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as expired:
            code, output = -999, f"timed out after {timeout_s} s\n{expired.stdout}{expired.stderr}"
    return code, output, time.perf_counter() - began


def main() -> None:
    """Run both scripts alternately, print and write the counts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs of each script")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--out", default="runs/exit-codes.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scripts:
        control = Path(scripts) / "quickstart_plain_ddp.py"
        control.write_text(plain_ddp(QUICK_START.read_text()))
        scripts_by_name = {"thinwire": QUICK_START, "plain-ddp": control}
        codes: dict[str, collections.Counter] = {n: collections.Counter() for n in scripts_by_name}
        failures: dict[str, list[dict]] = {n: [] for n in scripts_by_name}
        seconds: dict[str, list[float]] = {n: [] for n in scripts_by_name}
        for index in range(args.runs):
            for name, script in scripts_by_name.items():
                code, output, took = run_once(script, args.timeout)
                codes[name][code] += 1
                seconds[name].append(took)
                if code != 0:
                    failures[name].append({"run": index, "code": code, "tail": output[-3000:]})
                print(f"run {index + 1}/{args.runs} {name}: exit {code} ({took:.1f} s)", flush=True)
    result = {
        "runs": args.runs,
        "command": "torchrun --nproc-per-node 2 examples/quickstart_ddp.py",
        "exit_codes": {n: {str(k): v for k, v in c.items()} for n, c in codes.items()},
        "median_s": {n: sorted(s)[len(s) // 2] for n, s in seconds.items()},
        "failures": failures,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for name, counter in codes.items():
        print(f"{name}: {counter.get(0, 0)} of {args.runs} exited 0; codes {dict(counter)}")


if __name__ == "__main__":
    main()
