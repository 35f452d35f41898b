"""Link faults during a benchmark: ``thinwire bench --fault 1:down=5s@20``.

Each ``--fault HOST:KIND=VALUE@STEP`` is ordered on the emulated cluster
(:meth:`~thinwire.cluster.emulated.EmulatedCluster.fault`) when a method's run reaches
``STEP``, in every method's run, so that the methods meet the same fault at the same point:
``down=5s`` (host ``HOST``'s link drops every packet that long, then comes back),
``loss=0.01`` (a share of its packets lost) or ``rate=10mbit`` (its downlink slowed). Loss
and rate stay until the run ends; every host's link is then restored before the next
method. A fault that outlasts the collectives' timeout makes every rank raise
``CommunicationError`` and ends the benchmark there, as it would end a training job.
Each record lists the faults applied and at which step (``faults``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from thinwire.cluster.faults import fault_order

_SPEC = re.compile(r"^(\d+):(down|loss|rate)=([^@\s]+)@(\d+)$")


@dataclass(frozen=True)
class ScheduledFault:
    """Host ``host``'s link gets fault ``kind`` (``down``, ``loss``, ``rate``) of ``value``
    when a run reaches step ``step``."""

    host: int
    kind: str
    value: str
    step: int

    def order(self) -> dict[str, Any]:
        """The keyword arguments of ``EmulatedCluster.fault`` (checked)."""
        value: Any = float(self.value) if self.kind == "loss" else self.value
        return {"host": self.host, self.kind: value}

    def __str__(self) -> str:
        return f"{self.host}:{self.kind}={self.value}@{self.step}"


def parse_fault(text: str, hosts: int, steps: int) -> ScheduledFault:
    """``HOST:KIND=VALUE@STEP`` checked against a run of ``hosts`` hosts and ``steps``."""
    match = _SPEC.match(text.strip())
    if match is None:
        raise ValueError(
            f"--fault {text!r}: write HOST:KIND=VALUE@STEP, KIND one of down, loss, rate, "
            "e.g. 1:down=5s@20, 2:loss=0.01@10, 0:rate=10mbit@30"
        )
    host, kind, value, step = int(match[1]), match[2], match[3], int(match[4])
    if kind == "loss":
        try:
            float(value)
        except ValueError:
            raise ValueError(f"--fault {text!r}: loss must be a share such as 0.01") from None
    fault = ScheduledFault(host, kind, value, step)
    try:
        fault_order(hosts=hosts, **fault.order())
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"--fault {text!r}: {error}") from None
    if step >= steps:
        raise ValueError(f"--fault {text!r}: step {step} is past the run's {steps} steps")
    return fault


class FaultSchedule:
    """Orders one run's faults as it reaches their steps (:meth:`poll`), and undoes them
    all at its end (:meth:`clear`). ``order(**kwargs)``: the cluster's ``fault``."""

    def __init__(self, faults: Sequence[ScheduledFault], order: Callable[..., None]) -> None:
        self.faults, self.order = list(faults), order
        self.applied: list[dict[str, Any]] = []
        self._began = time.perf_counter()

    def poll(self, step: int) -> None:
        """Order every fault whose step the run has reached and that is not ordered yet."""
        for fault in self.faults:
            if step >= fault.step and not any(a["fault"] == str(fault) for a in self.applied):
                self.order(**fault.order())
                elapsed = time.perf_counter() - self._began
                self.applied.append({"fault": str(fault), "at_step": step, "at_s": elapsed})

    def clear(self) -> None:
        """Every faulted host's link back as the cluster was built."""
        for host in sorted({f.host for f in self.faults}):
            self.order(host=host, clear=True)
