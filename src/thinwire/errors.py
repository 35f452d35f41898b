"""Errors thinwire raises; each message says what was wrong and what to do."""

from __future__ import annotations


class ThinwireError(RuntimeError):
    """Base class of thinwire's runtime errors."""


class IncompatibleCompressorError(ValueError):
    """A compressor was paired with a communicator that cannot aggregate its payloads."""


class NonFiniteGradientError(ThinwireError):
    """A gradient contained NaN or Inf; raised on every rank after the same collective."""


class NonFiniteGradientWarning(UserWarning):
    """A step was skipped on the device for a NaN or Inf gradient on some rank (a GPU step
    refused without reading its verdict); warned once the host sees the verdict."""


class RankMismatchError(ThinwireError):
    """Ranks disagree on the model, the compressor or the bucket layout."""


class CommunicationError(ThinwireError):
    """A collective failed or timed out, usually because a peer rank died or stalled."""


class CheckpointError(ThinwireError):
    """A checkpoint could not be written, or is damaged or belongs to another setup."""
