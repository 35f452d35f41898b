"""thinwire in PyTorch Lightning: a ``Callback``.

    from thinwire.integrations.lightning import ThinwireCallback
    trainer = L.Trainer(strategy="ddp", callbacks=[ThinwireCallback("dgc", density=0.01)])

The callback registers thinwire's hook on the DDP model Lightning builds (in
``on_fit_start``: ``setup()`` is too early, and ``DDPStrategy(ddp_comm_hook=...)`` is
ignored on the CPU), logs ``thinwire/compression_ratio`` and the bytes of every exchanged
step through ``LightningModule.log``, and keeps every rank's compressor state in
Lightning's checkpoints (which rank 0 writes), so ``trainer.fit(ckpt_path=...)`` resumes
every rank exactly. Works with ``strategy="ddp"`` (launched by Lightning or ``torchrun``)
and ``"ddp_spawn"``.
"""

from __future__ import annotations

from typing import Any

from thinwire.data_parallel.ddp_hook import register
from thinwire.integrations.common import AllRanksState, ddp_model, require, step_figures

_lightning = require("lightning.pytorch", "lightning")


class ThinwireCallback(_lightning.Callback):
    """Exchange a Lightning DDP model's gradients through a thinwire compressor.

    Args:
        compressor: a registered name (``thinwire.compressors()``) or an instance.
        communicator: as in :func:`thinwire.register`.
        fuse_rounds: as in :func:`thinwire.register`.
        **options: the compressor's options (``density=0.01``, ``rank=2``, ...).

    ``engine`` is the :class:`~thinwire.GradientExchange` once fitting has started.
    With several optimizers, the first is checked against the compressor.
    """

    def __init__(
        self,
        compressor: Any = "dgc",
        *,
        communicator: str = "auto",
        fuse_rounds: bool = True,
        **options: Any,
    ) -> None:
        self.compressor = compressor
        self.communicator = communicator
        self.fuse_rounds = fuse_rounds
        self.options = options
        self._state = AllRanksState()
        self._logged_step = -1

    @property
    def engine(self) -> Any:
        """The exchange engine (``None`` before ``on_fit_start``)."""
        return self._state.engine

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Register the hook on the DDP model the strategy has just built."""
        model = ddp_model(
            trainer.strategy.model,
            "Lightning",
            "use Trainer(strategy='ddp') or 'ddp_spawn' with more than one process",
        )
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        engine = register(
            model,
            self.compressor,
            communicator=self.communicator,
            optimizer=optimizer,
            fuse_rounds=self.fuse_rounds,
            **self.options,
        )
        self._state.attach(engine)
        self._logged_step = engine.step - 1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        """Log the figures of a step that exchanged (not of accumulating micro-batches)."""
        stats = self.engine.last_step if self.engine is not None else None
        if stats is None or stats.step == self._logged_step:
            return
        self._logged_step = stats.step
        pl_module.log_dict(step_figures(stats), on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's compressor state (Lightning calls this on every rank)."""
        return self._state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's part (kept until the engine exists)."""
        self._state.load_state_dict(state_dict)
