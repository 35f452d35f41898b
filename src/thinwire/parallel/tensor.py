"""Tensor parallelism: each block's projections split over the ``"tp"`` group, with
PyTorch's ``ColwiseParallel`` and ``RowwiseParallel`` (Megatron's layout: query, key, value,
up and gate split by output features, attention's output and the MLP's down by input
features, so a block costs one all-reduce after attention and one after the MLP, forward
and backward); the token embedding and the head split by vocabulary. The head's logits stay
sharded: :mod:`thinwire.parallel.loss` computes the cross entropy from the shards.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from thinwire.parallel.layout import ModelLayout
from thinwire.parallel.stages import StageModule


def check_tensor_parallel(layout: ModelLayout, tp: int) -> None:
    """Refuse a degree that does not divide the heads, the MLP or the vocabulary, and
    tensor parallelism of a model that cannot have it."""
    if tp > 1 and layout.tensor_parallel:
        raise ValueError(
            f"this model cannot run tensor parallel (tp={tp}): {layout.tensor_parallel}. Use "
            "tp=1 with data and pipeline parallelism"
        )
    sizes = {
        "attention heads": layout.heads,
        "key/value heads": layout.kv_heads,
        "MLP hidden size": layout.hidden,
        "vocabulary": layout.vocab,
    }
    bad = {name: size for name, size in sizes.items() if size % tp}
    if bad:
        listed = ", ".join(f"{name} {size}" for name, size in bad.items())
        raise ValueError(
            f"tp={tp} does not divide the model's {listed}: each tensor-parallel rank takes "
            f"an equal share. Use a tp that divides {', '.join(map(str, bad.values()))} "
            "(or pad the vocabulary to a multiple of tp)"
        )


def apply_tensor_parallel(stage: StageModule, mesh: DeviceMesh) -> None:
    """Shard ``stage``'s blocks, and its embedding or head, over ``mesh`` (the ``"tp"``
    dimension), in place. Hidden states between blocks and between stages stay whole
    (replicated); the head gives each rank its vocabulary shard of the logits."""
    layout = stage.layout
    plan = {path: ColwiseParallel() for path in layout.column}
    plan.update({path: RowwiseParallel() for path in layout.row})
    for block in stage.blocks():
        parallelize_module(block, mesh, plan)
    if stage.first:
        parallelize_module(
            stage.model,
            mesh,
            {
                layout.embedding: RowwiseParallel(
                    input_layouts=Replicate(), output_layouts=Replicate()
                )
            },
        )
    if stage.last:
        parallelize_module(
            stage.model,
            mesh,
            {layout.head: ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)},
        )
