"""thinwire in Hugging Face Accelerate: one call after ``accelerator.prepare``.

    model, opt, loader = accelerator.prepare(model, opt, loader)
    engine = thinwire.integrations.accelerate.register(accelerator, model, "dgc", density=0.01)

The engine's state (every rank's) is registered for ``accelerator.save_state`` /
``load_state``, which write rank 0's copy: every rank resumes its own part. Gradient
accumulation works as with DDP (``accelerator.accumulate`` skips the exchange of
micro-batches that accumulate). Launch on CPU machines with
``torchrun --nproc-per-node N script.py`` and ``Accelerator(cpu=True)``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from thinwire.comm.engine import GradientExchange
from thinwire.data_parallel.ddp_hook import register as register_hook
from thinwire.integrations.common import AllRanksState, ddp_model, require

require("accelerate", "accelerate")


def register(
    accelerator: Any,
    model: nn.Module,
    compressor: Any = "dgc",
    *,
    optimizer: Any = None,
    **options: Any,
) -> GradientExchange:
    """Register thinwire's hook on ``model`` (as ``accelerator.prepare`` returned it) and
    its state for Accelerate's checkpoints. ``optimizer``: checked against the compressor
    (Accelerate's wrapper or the optimizer itself). ``options``: as for
    :func:`thinwire.register`. Returns the engine (``engine.last_step`` after each step)."""
    model = ddp_model(
        model,
        "Accelerate",
        "pass the model returned by accelerator.prepare, in a job of several processes "
        "(torchrun --nproc-per-node N)",
    )
    inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps one
    engine = register_hook(model, compressor, optimizer=inner, **options)
    state = AllRanksState()
    state.attach(engine)
    accelerator.register_for_checkpointing(state)
    return engine
