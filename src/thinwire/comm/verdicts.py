"""The message of a step refused for a non-finite gradient."""

from __future__ import annotations


def non_finite_message(step: int, rank: int, keys: list[str], compressor: str = "") -> str:
    """Why the step was refused, where (this rank's tensors ``keys``, or another rank's),
    and what to do."""
    where = (
        f"on this rank ({rank}) in {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
        if keys
        else f"on another rank (rank {rank}'s own gradients were finite)"
    )
    if not keys and compressor == "fp16":
        where += (
            ", or in fp16 payloads: fp16 holds magnitudes up to 65504, so larger gradients "
            "(or their sum over the ranks) overflow to Inf; use bf16, or scale the loss down"
        )
    return (
        f"non-finite gradient (NaN or Inf) at step {step}, {where}; the averaged gradient "
        "would be garbage, so no rank applied it. Lower the learning rate, clip gradients, "
        "or check the loss and the input data for NaN/Inf."
    )
