"""Layouts of Hugging Face ``transformers`` models, built from a config (no download):
``GPT2LMHeadModel`` and ``LlamaForCausalLM`` (and models shaped like them).

Each stage runs the blocks as the model's own forward does: the causal mask from
``transformers``' ``create_causal_mask``, Llama's rotary embeddings from the model's
``rotary_emb`` (kept on every stage: it has no parameters). GPT-2's attention fuses query,
key and value in one ``Conv1D``, which PyTorch's ``ColwiseParallel`` cannot split, so GPT-2
runs data and pipeline parallel only (``tp=1``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from thinwire.parallel.layout import ModelLayout


def _positions(x: Tensor) -> Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def _causal_mask(model: nn.Module, hidden: Tensor) -> Any:
    try:
        from transformers.masking_utils import create_causal_mask
    except ImportError as error:
        raise ImportError(
            "thinwire runs Hugging Face blocks with transformers.masking_utils, which this "
            "transformers lacks: upgrade it (tested with 5.23)"
        ) from error

    return create_causal_mask(
        config=model.config,
        inputs_embeds=hidden,
        attention_mask=None,
        past_key_values=None,
        position_ids=_positions(hidden),
    )


def _gpt2_embed(model: nn.Module, tokens: Tensor) -> Tensor:
    inner = model.transformer
    return inner.drop(inner.wte(tokens) + inner.wpe(_positions(tokens)))


def _gpt2_block(model: nn.Module, block: nn.Module, hidden: Tensor) -> Tensor:
    out = block(hidden, None, _causal_mask(model, hidden), position_ids=_positions(hidden))
    return out[0] if isinstance(out, tuple) else out


def read_gpt2(model: nn.Module) -> ModelLayout | None:
    """The layout of a ``GPT2LMHeadModel`` (``transformer.h`` blocks)."""
    inner = getattr(model, "transformer", None)
    if type(model).__name__ != "GPT2LMHeadModel" or inner is None:
        return None
    config = model.config
    return ModelLayout(
        blocks="transformer.h",
        first=("transformer.wte", "transformer.wpe"),
        last=("transformer.ln_f", "lm_head"),
        embedding="transformer.wte",
        head="lm_head",
        column=(),
        row=(),
        heads=config.n_head,
        kv_heads=config.n_head,
        hidden=config.n_inner or 4 * config.n_embd,
        vocab=config.vocab_size,
        embed=_gpt2_embed,
        run_block=_gpt2_block,
        finish=lambda m, x: m.lm_head(m.transformer.ln_f(x)),
        tensor_parallel=(
            "GPT-2's attention fuses query, key and value in one Conv1D (c_attn), which "
            "PyTorch's ColwiseParallel cannot split"
        ),
    )


def _llama_block(model: nn.Module, block: nn.Module, hidden: Tensor) -> Tensor:
    inner = model.model
    positions = _positions(hidden)
    out = block(
        hidden,
        attention_mask=_causal_mask(model, hidden),
        position_ids=positions,
        position_embeddings=inner.rotary_emb(hidden, position_ids=positions),
    )
    return out[0] if isinstance(out, tuple) else out


def read_llama(model: nn.Module) -> ModelLayout | None:
    """The layout of a ``LlamaForCausalLM`` (``model.layers`` blocks) or a model shaped
    like it (Mistral, Qwen2: the same module names)."""
    inner = getattr(model, "model", None)
    names = {"embed_tokens", "layers", "norm", "rotary_emb"}
    if inner is None or not names <= {n for n, _ in inner.named_children()}:
        return None
    if not hasattr(model, "lm_head"):
        return None
    config = model.config
    return ModelLayout(
        blocks="model.layers",
        first=("model.embed_tokens",),
        last=("model.norm", "lm_head"),
        embedding="model.embed_tokens",
        head="lm_head",
        column=(
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ),
        row=("self_attn.o_proj", "mlp.down_proj"),
        heads=config.num_attention_heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        hidden=config.intermediate_size,
        vocab=config.vocab_size,
        embed=lambda m, tokens: m.model.embed_tokens(tokens),
        run_block=_llama_block,
        finish=lambda m, x: m.lm_head(m.model.norm(x)),
    )
