"""Run a function in a fresh Python process and get its result back.

The profilers time each part of a model alone on a core, in a process that joins PyTorch's
fake process group; the caller may already be a rank of a real group (``parallelize(model,
"auto")`` under torchrun), a daemon worker (which may not have children of its own) or a
script without a ``__main__`` guard (which multiprocessing's spawn would run again). So the
child is a plain ``python -m thinwire.plan.fresh_process``: it unpickles the function and
its arguments from a file, runs it, and pickles the result, or the exception it raised,
into another.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_fresh(fn: Any, *args: Any, timeout: float | None = None) -> Any:
    """``fn(*args)`` in a fresh process; its exception is raised here."""
    with tempfile.TemporaryDirectory(prefix="thinwire-fresh-") as folder:
        given, answer = Path(folder) / "call.pkl", Path(folder) / "result.pkl"
        given.write_bytes(pickle.dumps((fn, args)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        done = subprocess.run(
            [sys.executable, "-m", "thinwire.plan.fresh_process", str(given), str(answer)],
            env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if not answer.exists():
            raise RuntimeError(
                f"the fresh process running {getattr(fn, '__name__', fn)} exited with code "
                f"{done.returncode} and no result:\n{done.stderr[-3000:]}"
            )
        ok, value = pickle.loads(answer.read_bytes())
    if not ok:
        raise value
    return value


def main(given: str, answer: str) -> None:
    """The child: call what ``given`` holds, write ``(ok, result or exception)``."""
    try:
        fn, args = pickle.loads(Path(given).read_bytes())
        result: tuple[bool, Any] = (True, fn(*args))
    except Exception as error:
        if isinstance(error, AttributeError | ModuleNotFoundError) and "__main__" in str(error):
            error = RuntimeError(
                f"{error}: the model is profiled in a fresh process, which cannot see the "
                "classes of the script torchrun runs; define the model's class in a module "
                "(importable on PYTHONPATH), or plan with 'thinwire plan' and pass the plan"
            )
        try:
            pickle.dumps(error)
        except Exception:
            error = RuntimeError(f"{type(error).__name__}: {error}")
        result = (False, error)
    Path(answer).write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
