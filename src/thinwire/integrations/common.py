"""What the framework integrations share: finding the DDP model, the all-ranks state as a
checkpointable object, and the per-step figures they log."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire.comm.engine import GradientExchange, StepStats


def require(module: str, extra: str) -> ModuleType:
    """Import the framework ``module`` or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"thinwire.integrations.{extra} needs {module}, which is not installed: "
            f"pip install 'thinwire[{extra}]'"
        ) from error


def ddp_model(model: nn.Module, framework: str, how: str) -> DistributedDataParallel:
    """``model`` if it is a DDP model, else an error saying how to get one from
    ``framework`` (``how``: the setting that makes it wrap models in DDP)."""
    if isinstance(model, DistributedDataParallel):
        return model
    raise TypeError(
        f"thinwire needs the DistributedDataParallel model that {framework} builds, but "
        f"the model here is a {type(model).__name__}: {how}. (thinwire compresses the "
        "gradients DDP exchanges; a single process exchanges none.)"
    )


class AllRanksState:
    """An engine's state as a framework checkpoints it: ``state_dict()`` gathers every
    rank's (a collective: frameworks call it on every rank, then rank 0 writes), and
    ``load_state_dict()`` takes this rank's part; a state given before the engine exists
    (frameworks restore before they build DDP) is kept and loaded when it is attached."""

    def __init__(self) -> None:
        self.engine: GradientExchange | None = None
        self._pending: dict[str, Any] | None = None

    def attach(self, engine: GradientExchange) -> None:
        """Use ``engine``, loading a state restored before it existed."""
        self.engine = engine
        if self._pending is not None:
            pending, self._pending = self._pending, None
            engine.load_state_dict(pending)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's state (empty before the engine exists). Collective."""
        return {"exchange": self.engine.full_state_dict()} if self.engine is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, now or once an engine is attached."""
        if not state:
            return
        if "exchange" not in state:
            raise ValueError(
                "not a thinwire integration state (no 'exchange' entry): it was saved by "
                "another callback or object; resume without it to start the compressor fresh"
            )
        if self.engine is None:
            self._pending = state["exchange"]
        else:
            self.engine.load_state_dict(state["exchange"])


def step_figures(stats: StepStats) -> dict[str, float]:
    """What a framework logs for one exchanged step (the ratio only if bytes were sent)."""
    figures = {
        "thinwire/payload_bytes": float(stats.payload_bytes),
        "thinwire/sent_bytes": float(stats.sent_bytes),
        "thinwire/dense_bytes": float(stats.dense_bytes),
    }
    if stats.payload_bytes:
        figures["thinwire/compression_ratio"] = stats.compression_ratio
    return figures
