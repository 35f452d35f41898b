"""Exit codes of ranks that end while thinwire's threads are still busy.

    python bench/exit_on_error.py --runs 10 --out runs/exit-on-error.json
    python bench/exit_on_error.py --runs 10 --src /path/to/other/src   # another version
    python bench/exit_on_error.py --case ps-no-close --runs 10

Each run starts 2 gloo ranks (directly, not under torchrun, so each exits on its own) and
runs one ``--case``:

* ``raise``: a few steps under ``DelayedAveraging`` (its corrections travel on the exchange
  thread while the next step computes), then the user's own error with corrections in
  flight: Python's exit code 1 expected;
* ``destroy-busy``: the same steps, then ``dist.destroy_process_group()`` with the
  corrections still in flight, then a normal end: 0 expected;
* ``ps-no-close``: a few synchronous parameter-server steps (a shard on rank 0, on a thread
  of its own), no ``close()``, rank 1 a second later than rank 0 (whose shard still waits
  for it), then ``dist.destroy_process_group()``: 0 expected;
* ``ps-exit-no-close``: the same without the destroy (the interpreter's exit only): 0.

A process that aborts at exit (SIGABRT, "terminate called without an active exception": a
thread still inside a collective when the process groups are torn down) exits with 134 or
-6. Counts the codes of both ranks.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from thinwire.launch import free_port

ROOT = Path(__file__).resolve().parent.parent

DELAYED = """
import torch, torch.distributed as dist
import thinwire
from thinwire.tasks.digits import DigitsMLP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DigitsMLP(512)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
front = thinwire.DelayedAveraging(opt, model, "powersgd", delay=2, rank=4)
for step in range(6):
    front.zero_grad()
    model(torch.randn(64, 64)).sum().backward()
    front.step()
"""

PS = """
import torch, torch.distributed as dist
import thinwire
from thinwire.tasks.digits import DigitsMLP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DigitsMLP(512)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ps = thinwire.ParameterServer(opt, model, "none")
for step in range(5):
    opt.zero_grad()
    model(torch.randn(64, 64)).sum().backward()
    ps.step()
if dist.get_rank() == 1:  # rank 0 ends first, its shard still waiting for this worker
    import time
    time.sleep(1.0)
"""

#: case -> (script, the exit code a clean end has)
CASES = {
    "raise": (DELAYED + 'raise RuntimeError("the user\'s own error, corrections in flight")\n', 1),
    "destroy-busy": (DELAYED + "dist.destroy_process_group()\n", 0),
    "ps-no-close": (PS + "dist.destroy_process_group()\nassert ps._closed, 'left open'\n", 0),
    "ps-exit-no-close": (PS, 0),
}


def run_once(script: Path, src: Path, timeout_s: float) -> list[tuple[int, str]]:
    """Both ranks' exit codes and the ends of their output."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(src),
        }  # fmt: skip
        output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, **output))
    outcome = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            outcome.append((-999, f"timed out after {timeout_s} s\n{output[-1500:]}"))
            continue
        outcome.append((proc.returncode, output[-1500:]))
    return outcome


def main() -> None:
    """Run, count, write."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), default="raise")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--src", default=str(ROOT / "src"), help="thinwire's source to test")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument("--out", default="runs/exit-on-error.json")
    args = parser.parse_args()
    text, expected = CASES[args.case]
    codes: collections.Counter = collections.Counter()
    aborted = []
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / f"{args.case.replace('-', '_')}.py"
        script.write_text(text)
        for index in range(args.runs):
            outcome = run_once(script, Path(args.src), args.timeout)
            for rank, (code, tail) in enumerate(outcome):
                codes[code] += 1
                if code != expected:
                    aborted.append({"run": index, "rank": rank, "code": code, "tail": tail})
            print(f"run {index + 1}/{args.runs}: exit codes {[c for c, _ in outcome]}", flush=True)
    result = {
        "case": args.case,
        "expected_code": expected,
        "runs": args.runs,
        "src": args.src,
        "exit_codes": {str(k): v for k, v in codes.items()},
        "not_python_exit": aborted,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{codes.get(expected, 0)} of {2 * args.runs} rank exits were {expected}; {dict(codes)}")


if __name__ == "__main__":
    main()
