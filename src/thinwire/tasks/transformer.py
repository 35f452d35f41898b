"""Decoder-only language models: a GPT-2-style one and a Llama-style one (RoPE, RMSNorm,
SwiGLU), in plain PyTorch with no distributed code.

Both have the same shape, which :func:`thinwire.parallelize` reads from the module
structure: ``embed`` (tokens to hidden states), ``blocks`` (an ``nn.ModuleList``),
``norm`` and ``head`` (hidden states to logits). Attention keeps its query, key, value and
output projections separate (``q``, ``k``, ``v``, ``o``) and works out its number of heads
from the projection's width, so a tensor-parallel shard with fewer heads runs the same code.

    model = TransformerLM(TransformerConfig(style="llama", vocab=512, dim=128, layers=4, heads=4))
    logits = model(tokens)            # tokens: (batch, seq) int64 -> (batch, seq, vocab)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

STYLES = ("gpt", "llama")


@dataclass(frozen=True)
class TransformerConfig:
    """The shape of a :class:`TransformerLM`."""

    style: str = "gpt"
    """``"gpt"`` (learned positions, LayerNorm, GELU MLP, biases) or ``"llama"`` (rotary
    positions, RMSNorm, SwiGLU MLP, no biases)."""
    vocab: int = 512
    """Vocabulary size."""
    dim: int = 128
    """Hidden size."""
    layers: int = 4
    """Number of transformer blocks."""
    heads: int = 4
    """Attention heads; ``dim`` must be a multiple."""
    mlp_ratio: float = 4.0
    """The MLP's hidden size over ``dim`` (Llama-style: two thirds of it, rounded to 8)."""
    max_seq: int = 256
    """Longest sequence (the GPT's position table has this many rows)."""
    dropout: float = 0.0
    """Probability of dropping each feature of the attention's and the MLP's output
    (before the residual add) in training."""

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {self.style!r}")
        for name in ("vocab", "dim", "layers", "heads", "max_seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.dim % self.heads:
            raise ValueError(
                f"dim ({self.dim}) must be a multiple of heads ({self.heads}): each head "
                "takes dim / heads features"
            )
        if (self.dim // self.heads) % 2 and self.style == "llama":
            raise ValueError(
                f"rotary positions need an even head size, got dim / heads = "
                f"{self.dim // self.heads}"
            )
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio!r}")

    @property
    def head_dim(self) -> int:
        """Features per attention head."""
        return self.dim // self.heads

    @property
    def hidden(self) -> int:
        """The MLP's hidden size."""
        hidden = int(self.dim * self.mlp_ratio)
        if self.style == "llama":
            hidden = max(8, round(hidden * 2 / 3 / 8) * 8)
        return hidden


def rotate(x: Tensor) -> Tensor:
    """Rotary position embedding of ``x`` (batch, heads, seq, head_dim), computed from its
    sequence length (no buffer, so a pipeline stage needs nothing from another)."""
    seq, half = x.shape[-2], x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angle = torch.arange(seq, dtype=torch.float32, device=x.device)[:, None] * freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with separate ``q``, ``k``, ``v`` and ``o`` projections."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        bias = config.style == "gpt"
        self.head_dim = config.head_dim
        self.rotary = config.style == "llama"
        self.q = nn.Linear(config.dim, config.dim, bias=bias)
        self.k = nn.Linear(config.dim, config.dim, bias=bias)
        self.v = nn.Linear(config.dim, config.dim, bias=bias)
        self.o = nn.Linear(config.dim, config.dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """(batch, seq, dim) -> (batch, seq, dim)."""
        batch, seq, _ = x.shape
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        if self.rotary:
            q, k = rotate(q), rotate(k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """GELU MLP (``up``, ``down``) or SwiGLU (``gate``, ``up``, ``down``)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        bias = config.style == "gpt"
        self.gate = nn.Linear(config.dim, config.hidden, bias=False) if not bias else None
        self.up = nn.Linear(config.dim, config.hidden, bias=bias)
        self.down = nn.Linear(config.hidden, config.dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """(batch, seq, dim) -> (batch, seq, dim)."""
        if self.gate is None:
            return self.down(F.gelu(self.up(x)))
        return self.down(F.silu(self.gate(x)) * self.up(x))


def norm_layer(config: TransformerConfig) -> nn.Module:
    """LayerNorm for the GPT, RMSNorm for the Llama-style model."""
    return nn.LayerNorm(config.dim) if config.style == "gpt" else nn.RMSNorm(config.dim)


class Block(nn.Module):
    """A pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = norm_layer(config)
        self.attn = Attention(config)
        self.mlp_norm = norm_layer(config)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(batch, seq, dim) -> (batch, seq, dim)."""
        x = x + self.drop(self.attn(self.attn_norm(x)))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Embedding(nn.Module):
    """Token embedding, plus learned positions for the GPT."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.dim)
        self.positions = nn.Embedding(config.max_seq, config.dim) if config.style == "gpt" else None

    def forward(self, tokens: Tensor) -> Tensor:
        """(batch, seq) int64 -> (batch, seq, dim)."""
        x = self.tokens(tokens)
        if self.positions is not None:
            x = x + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        return x


class TransformerLM(nn.Module):
    """A decoder-only language model: ``embed``, ``blocks``, ``norm``, ``head``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = norm_layer(config)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)
        self.apply(_init_weights)

    def forward(self, tokens: Tensor) -> Tensor:
        """(batch, seq) int64 -> logits (batch, seq, vocab)."""
        if tokens.shape[1] > self.config.max_seq:
            raise ValueError(
                f"sequence of {tokens.shape[1]} tokens is longer than max_seq "
                f"({self.config.max_seq}); build the model with a larger max_seq"
            )
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: normal(0, 0.02) weights, zero biases."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
