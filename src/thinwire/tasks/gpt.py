"""The ``gpt`` task: a GPT-2-style or Llama-style decoder on the CPython sources as BPE
tokens (:mod:`thinwire.tasks.tokens`); metric: held-out perplexity per token.

For hybrid parallelism every rank is given the same global batch (:meth:`GPTTask.global_batch`)
and :func:`thinwire.parallelize`'s trainer takes each data-parallel rank's slice; for data
parallelism :meth:`GPTTask.batch` gives each rank its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from thinwire.tasks.base import Task, check_rank, seeded_init, step_generator
from thinwire.tasks.registry import register_task
from thinwire.tasks.tokens import TokenCorpus, load_tokens
from thinwire.tasks.transformer import TransformerConfig, TransformerLM


@register_task
@dataclass(frozen=True)
class GPTTask(Task):
    """A decoder-only transformer on BPE tokens of the stdlib sources.

    Options:
        seed: model initialisation and batch sampling.
        style: ``"gpt"`` (GPT-2-style) or ``"llama"`` (RoPE, RMSNorm, SwiGLU).
        vocab: BPE vocabulary size (trained once on the training files, cached).
        dim, layers, heads: the transformer.
        seq_len: tokens per sequence.
        batch_size: sequences per step (the global batch under hybrid parallelism, per
            rank under data parallelism).
        max_bytes: train on the first this many bytes of the corpus (``None``: all).
        eval_tokens: held-out tokens the metric is measured on.
        dropout: dropout of the attention's and MLP's outputs in training.
    """

    name = "gpt"
    summary = "stdlib Python sources as BPE tokens, GPT-2- or Llama-style decoder; perplexity"
    metric = "perplexity"
    higher_is_better = False

    seed: int = 0
    style: str = "gpt"
    vocab: int = 2048
    dim: int = 256
    layers: int = 8
    heads: int = 8
    seq_len: int = 128
    batch_size: int = 32
    max_bytes: int | None = None
    eval_tokens: int = 32_768
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for option in ("vocab", "seq_len", "batch_size", "eval_tokens"):
            if getattr(self, option) < 1:
                raise ValueError(f"{option} must be positive, got {getattr(self, option)}")
        self.config()  # checks the model's shape

    def config(self) -> TransformerConfig:
        """The model's shape."""
        return TransformerConfig(
            style=self.style, vocab=self.vocab, dim=self.dim, layers=self.layers,
            heads=self.heads, max_seq=self.seq_len, dropout=self.dropout,
        )  # fmt: skip

    @property
    def corpus(self) -> TokenCorpus:
        """The token streams (made and cached on first use)."""
        return load_tokens(self.vocab, self.max_bytes)

    def build_model(self) -> nn.Module:
        """The transformer, initialised from ``seed``."""
        return seeded_init(self.seed, lambda: TransformerLM(self.config()))

    def _windows(self, generator: torch.Generator, count: int) -> tuple[Tensor, Tensor]:
        train = self.corpus.train
        starts = torch.randint(len(train) - self.seq_len - 1, (count,), generator=generator)
        windows = train[starts[:, None] + torch.arange(self.seq_len + 1)]
        return windows[:, :-1], windows[:, 1:]

    def global_batch(self, step: int) -> tuple[Tensor, Tensor]:
        """Step ``step``'s ``batch_size`` sequences and their next tokens, the same on every
        rank (sampled from a generator seeded with ``(seed, step)``)."""
        return self._windows(step_generator(self.seed, 0, step), self.batch_size)

    def batch(self, rank: int, world_size: int, step: int) -> tuple[Tensor, Tensor]:
        """``rank``'s own ``batch_size`` sequences for data-parallel training."""
        check_rank(rank, world_size, step=step)
        return self._windows(step_generator(self.seed, rank + 1, step), self.batch_size)

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Mean cross entropy per predicted token (nats)."""
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())

    def evaluation_windows(self) -> Tensor:
        """Held-out windows ``(n, seq_len + 1)``, spread evenly over the held-out stream."""
        stream = self.corpus.held_out
        span = self.seq_len + 1
        count = max(1, min(self.eval_tokens // self.seq_len, len(stream) - span + 1))
        starts = torch.linspace(0, len(stream) - span, count).long()
        return stream[starts[:, None] + torch.arange(span)]

    def evaluate(self, model: nn.Module) -> float:
        """Held-out perplexity per token of a whole model in this process."""
        windows = self.evaluation_windows()
        model.eval()
        with torch.no_grad():
            total = sum(
                float(self.loss(model(w[:, :-1]), w[:, 1:])) * len(w) for w in windows.split(32)
            )
        model.train()
        return math.exp(total / len(windows))

    def evaluate_parallel(self, trainer: Any, chunk: int) -> float:
        """Held-out perplexity per token through a :class:`~thinwire.ParallelTrainer`, in
        chunks of ``chunk`` windows (a multiple of ``dp * microbatches``; the remainder
        of the windows is left out)."""
        windows = self.evaluation_windows()
        usable = len(windows) - len(windows) % chunk
        if usable == 0:
            raise ValueError(
                f"{len(windows)} held-out windows do not fill one chunk of {chunk}: raise "
                "eval_tokens"
            )
        losses = [trainer.evaluate(w[:, :-1], w[:, 1:]) for w in windows[:usable].split(chunk)]
        return math.exp(sum(losses) / len(losses))
