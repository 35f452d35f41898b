"""The model the planner profiles, named so that a fresh process can build it again.

Either a thinwire task (``"gpt"`` with its options: ``{"style": "llama", "dim": 512}``),
whose model and first global batch are the task's, or a function of a user's module,
``"package.module:function"``, called with ``options`` as keyword arguments and returning
the ``nn.Module``: its inputs are random token ids (``batch_size`` sequences of
``seq_len``) from the vocabulary its layout names.
"""

from __future__ import annotations

import importlib
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

    @property
    def is_function(self) -> bool:
        """Whether ``name`` is ``module:function`` rather than a task."""
        return ":" in self.name

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
        return self._call_function() if self.is_function else self._task().build_model()

    def build(self) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
        """The model and one global batch (token ids and their targets)."""
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
