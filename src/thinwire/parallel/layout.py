"""Where a language model's parts are, read from its module structure (no tracing).

Pipeline parallelism needs the list of blocks (stages are cut between them), what runs
before them (the embedding, on the first stage) and after them (norm and head, on the last);
tensor parallelism needs each block's projections that are split by output features
(attention's query, key and value, the MLP's up and gate) and by input features (attention's
output, the MLP's down), and the vocabulary-sized layers. A :class:`ModelLayout` says all
that; :func:`read_layout` finds it for thinwire's transformers and Hugging Face's
``GPT2LMHeadModel`` and ``LlamaForCausalLM``, and says what to pass for anything else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn


@dataclass(frozen=True)
class ModelLayout:
    """A decoder's parts, as paths of its submodules, and how to run them.

    ``embed(model, tokens)`` gives the first block's input, ``run_block(model, block,
    hidden)`` runs one block and ``finish(model, hidden)`` gives the logits; each reads only
    the parts its stage holds.
    """

    blocks: str
    """Path of the ``nn.ModuleList`` of blocks (``"blocks"``, ``"model.layers"``)."""
    first: tuple[str, ...]
    """Paths of the modules that run before the blocks (first stage)."""
    last: tuple[str, ...]
    """Paths of the modules that run after the blocks (last stage)."""
    embedding: str
    """Path of the token ``nn.Embedding`` (sharded by vocabulary under tensor parallelism)."""
    head: str
    """Path of the output ``nn.Linear`` (sharded by vocabulary under tensor parallelism)."""
    column: tuple[str, ...]
    """Paths, within a block, of the linear layers split by output features."""
    row: tuple[str, ...]
    """Paths, within a block, of the linear layers split by input features."""
    heads: int
    """Attention (query) heads."""
    kv_heads: int
    """Key and value heads (fewer than ``heads`` under grouped-query attention)."""
    hidden: int
    """The MLP's hidden size."""
    vocab: int
    """Vocabulary size."""
    embed: Callable[[nn.Module, Tensor], Tensor]
    run_block: Callable[[nn.Module, nn.Module, Tensor], Tensor]
    finish: Callable[[nn.Module, Tensor], Tensor]
    tensor_parallel: str = ""
    """Why the model cannot be tensor parallel (empty: it can)."""


def submodule(root: nn.Module, path: str) -> nn.Module:
    """``root``'s submodule at ``path``, with an error naming the path if it is missing."""
    try:
        return root.get_submodule(path)
    except AttributeError as error:
        raise ValueError(f"{type(root).__name__} has no submodule {path!r} ({error})") from None


def read_layout(model: nn.Module) -> ModelLayout:
    """The layout of ``model``: thinwire's ``TransformerLM`` (or any model shaped like it:
    ``embed``, ``blocks``, ``norm``, ``head``), or a Hugging Face GPT-2 or Llama model."""
    from thinwire.parallel.layout_hf import read_gpt2, read_llama

    for reader in (*READERS, read_gpt2, read_llama):
        layout = reader(model)
        if layout is not None:
            return layout
    children = ", ".join(name for name, _ in model.named_children()) or "none"
    raise ValueError(
        f"thinwire cannot find the blocks of {type(model).__name__} (its children: "
        f"{children}): it reads models shaped like thinwire.tasks.transformer.TransformerLM "
        "(embed, blocks, norm, head) and Hugging Face GPT2LMHeadModel and LlamaForCausalLM. "
        "Pass layout=thinwire.parallel.ModelLayout(...) naming the block list, the modules "
        "before and after it and the projections to split"
    )


def _thinwire_shaped(model: nn.Module) -> ModelLayout | None:
    """thinwire's TransformerLM, or any model with the same parts."""
    names = {name for name, _ in model.named_children()}
    if not {"embed", "blocks", "norm", "head"} <= names or not isinstance(
        model.blocks, nn.ModuleList
    ):
        return None
    block = model.blocks[0]
    gated = getattr(block.mlp, "gate", None) is not None
    heads = block.attn.q.out_features // block.attn.head_dim
    return ModelLayout(
        blocks="blocks",
        first=("embed",),
        last=("norm", "head"),
        embedding="embed.tokens",
        head="head",
        column=("attn.q", "attn.k", "attn.v", "mlp.up") + (("mlp.gate",) if gated else ()),
        row=("attn.o", "mlp.down"),
        heads=heads,
        kv_heads=block.attn.k.out_features // block.attn.head_dim,
        hidden=block.mlp.up.out_features,
        vocab=model.head.out_features,
        embed=lambda m, tokens: m.embed(tokens),
        run_block=lambda m, block, x: block(x),
        finish=lambda m, x: m.head(m.norm(x)),
    )


#: functions reading a model's layout (``None``: not theirs), tried in order before
#: the Hugging Face readers of :mod:`thinwire.parallel.layout_hf`
READERS: list[Callable[[nn.Module], ModelLayout | None]] = [_thinwire_shaped]
