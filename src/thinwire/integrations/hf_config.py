"""A Hugging Face causal language model built from a config alone (no weights fetched), for
the planner and the benchmarks: ``thinwire plan --model
thinwire.integrations.hf_config:from_config --model-options '{"model_type": "llama", ...}'``.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def from_config(model_type: str = "gpt2", seed: int = 0, **config: Any) -> nn.Module:
    """``transformers.AutoModelForCausalLM`` of ``model_type`` (``"gpt2"``, ``"llama"``,
    ...) with ``config``'s fields (``n_layer``, ``hidden_size``, ...), initialised from
    ``seed``. Needs ``pip install thinwire[transformers]``."""
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "building a Hugging Face model needs transformers: pip install 'thinwire[transformers]'"
        ) from error
    import torch

    settings = transformers.AutoConfig.for_model(model_type, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(settings)
