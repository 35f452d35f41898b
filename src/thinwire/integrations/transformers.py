"""thinwire in the Hugging Face ``Trainer``: a ``TrainerCallback``.

    trainer = Trainer(model=model, args=args, train_dataset=data)
    thinwire.integrations.transformers.register(trainer, "dgc", density=0.01)
    trainer.train()                       # or train(resume_from_checkpoint=True)

The callback registers thinwire's hook on the DDP model the Trainer builds (at
``on_train_begin``), adds ``thinwire/compression_ratio`` and the bytes of the last exchanged
step to every log line, and writes every rank's compressor state into each checkpoint
folder as ``thinwire.pt`` (the Trainer writes rank 0's files only). On resume it loads the
file of the checkpoint the Trainer resumed from: ``output_dir/checkpoint-<step>`` (the
Trainer's own naming), or the folder given as ``resume_from``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from thinwire.data_parallel.ddp_hook import register as register_hook
from thinwire.integrations.common import AllRanksState, ddp_model, require, step_figures

_transformers = require("transformers", "transformers")

#: the file each checkpoint folder gets
STATE_FILE = "thinwire.pt"


class ThinwireCallback(_transformers.TrainerCallback):
    """Exchange a ``Trainer``'s DDP gradients through a thinwire compressor (add it with
    :func:`register`, which puts it before the reporting callbacks).

    Args:
        trainer: the ``Trainer`` (its DDP model exists only once training begins).
        compressor: a registered name (``thinwire.compressors()``) or an instance.
        resume_from: the checkpoint folder to take thinwire's state from when the Trainer
            resumes from one outside ``output_dir`` (default: ``output_dir/checkpoint-N``).
        **options: the compressor's options (``density=0.01``, ``rank=2``, ...).
    """

    def __init__(
        self, trainer: Any, compressor: Any = "dgc", *, resume_from: str | None = None,
        **options: Any,
    ) -> None:  # fmt: skip
        self.trainer = trainer
        self.compressor = compressor
        self.resume_from = resume_from
        self.options = options
        self._state = AllRanksState()
        self._figures: dict[str, float] = {}

    @property
    def engine(self) -> Any:
        """The exchange engine (``None`` before training begins)."""
        return self._state.engine

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Register the hook; on a resume, load every rank's part of the saved state."""
        model = ddp_model(
            self.trainer.model_wrapped,
            "the Trainer",
            "launch with torchrun --nproc-per-node N (and TrainingArguments(use_cpu=True, "
            "ddp_backend='gloo') on CPU machines)",
        )
        optimizer = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)
        engine = register_hook(model, self.compressor, optimizer=optimizer, **self.options)
        self._state.attach(engine)
        if state.global_step > 0:
            self._resume(args, state.global_step)

    def _resume(self, args: Any, step: int) -> None:
        folder = self.resume_from or os.path.join(args.output_dir, f"checkpoint-{step}")
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"the Trainer resumes at step {step}, but {path} does not exist: thinwire's "
                "compressor state is saved there with each checkpoint. If the Trainer resumes "
                "from another folder, pass it as resume_from=; to start the compressor fresh, "
                "delete the folder's optimizer state too, or train from scratch."
            )
        self._state.load_state_dict(torch.load(path, weights_only=True))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Keep the figures of the step just exchanged for the next log line."""
        stats = self.engine.last_step if self.engine is not None else None
        self._figures = step_figures(stats) if stats is not None else {}

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        """Add the last exchanged step's figures to the log line that the callbacks after
        this one report, and to the Trainer's log history (which holds a copy)."""
        if logs is None or "loss" not in logs or not self._figures:
            return
        logs.update(self._figures)
        if state.log_history and state.log_history[-1].get("loss") == logs["loss"]:
            state.log_history[-1].update(self._figures)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Gather every rank's state (collective) into the checkpoint folder just written."""
        everyone = self._state.state_dict()
        if not everyone:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not dist.is_initialized() or dist.get_rank() == 0:
            os.makedirs(folder, exist_ok=True)
            torch.save(everyone, os.path.join(folder, STATE_FILE))
        if dist.is_initialized():
            dist.barrier()


def register(trainer: Any, compressor: Any = "dgc", **options: Any) -> ThinwireCallback:
    """Add a :class:`ThinwireCallback` to ``trainer`` and return it (``callback.engine``
    once training has begun). It goes first among the Trainer's callbacks, so that the
    reporting ones (TensorBoard, W&B, ...) see its figures in each log line."""
    callback = ThinwireCallback(trainer, compressor, **options)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
