"""The model the planner profiles, named so that a fresh process can build it again.

Either a thinwire task (``"gpt"`` with its options: ``{"style": "llama", "dim": 512}``),
whose model and first global batch are the task's, or a function of a user's module,
``"package.module:function"``, called with ``options`` as keyword arguments and returning
the ``nn.Module``: its inputs are random token ids (``batch_size`` sequences of
``seq_len``) from the vocabulary its layout names. Or a live model and its global batch,
pickled (:meth:`ModelSource.of_module`: what ``thinwire.parallelize(model, "auto")``
profiles; its classes must be importable, as for any spawned process).
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class ModelSource:
    """A task name or ``module:function``, its options, and (for a function) the batch."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    batch_size: int | None = None
    """Sequences per step (a task's own ``batch_size`` when ``None``)."""
    seq_len: int | None = None
    """Tokens per sequence (needed for a function; a task knows its own)."""
    live: bytes | None = None
    """A model and its global batch, pickled by :meth:`of_module`."""

    @classmethod
    def of_module(cls, model: nn.Module, batch: tuple[Tensor, Tensor]) -> ModelSource:
        """A live ``model`` with its global ``batch`` (token ids, targets)."""
        tokens = batch[0]
        if not isinstance(tokens, Tensor) or tokens.dim() != 2:
            raise ValueError(
                "example_inputs must be the global batch (token ids of shape (batch, "
                "sequence), targets) that trainer.step takes"
            )
        buffer = io.BytesIO()
        torch.save((model, tuple(batch)), buffer)
        return cls(
            f"{type(model).__name__} (given)",
            batch_size=tokens.shape[0],
            seq_len=tokens.shape[1],
            live=buffer.getvalue(),
        )

    @property
    def is_function(self) -> bool:
        """Whether ``name`` is ``module:function`` rather than a task."""
        return self.live is None and ":" in self.name

    def _unpickled(self) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
        assert self.live is not None
        model, batch = torch.load(io.BytesIO(self.live), weights_only=False)
        return model, batch

    def _task(self) -> Any:
        from thinwire.tasks import task

        options = dict(self.options)
        if self.batch_size is not None:
            options["batch_size"] = self.batch_size
        if self.seq_len is not None:
            options["seq_len"] = self.seq_len
        return task(self.name, **options)

    def build_model(self) -> nn.Module:
        """The model alone (under ``torch.device("meta")``: its shapes, nothing allocated)."""
        if self.live is not None:
            return self._unpickled()[0]
        return self._call_function() if self.is_function else self._task().build_model()

    def build(self) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
        """The model and one global batch (token ids and their targets)."""
        if self.live is not None:
            return self._unpickled()
        if not self.is_function:
            job = self._task()
            return job.build_model(), job.global_batch(0)
        model = self._call_function()
        if self.batch_size is None or self.seq_len is None:
            raise ValueError(
                f"model {self.name!r} is a function: say how large a batch it trains on "
                "(--batch-size and --seq-len, or batch_size= and seq_len=)"
            )
        from thinwire.parallel.layout import read_layout

        vocab = read_layout(model).vocab
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(vocab, (self.batch_size, self.seq_len + 1), generator=generator)
        return model, (tokens[:, :-1], tokens[:, 1:])

    def _call_function(self) -> nn.Module:
        module_name, _, function_name = self.name.partition(":")
        try:
            function = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as error:
            raise ValueError(
                f"cannot load model {self.name!r} ({error}): write module:function, where "
                "module is importable (on PYTHONPATH) and function returns the nn.Module"
            ) from error
        model = function(**dict(self.options))
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{self.name} returned {type(model).__name__}, not an nn.Module: return the "
                "model (built from its config, on the CPU)"
            )
        return model

    def batch(self) -> int:
        """Sequences per step (the global batch a plan splits)."""
        if self.batch_size is not None:
            return self.batch_size
        if self.is_function:
            raise ValueError(f"model {self.name!r} is a function: pass its batch size")
        return int(self._task().batch_size)
