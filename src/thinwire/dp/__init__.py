"""Data-parallel front ends built on the gradient exchange engine (:mod:`thinwire.comm`)."""

from thinwire.dp.delayed import DelayedAveraging

__all__ = ["DelayedAveraging"]
