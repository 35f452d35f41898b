"""What one optimizer step exchanged, as one rank saw it."""

from __future__ import annotations

from dataclasses import dataclass, field

from thinwire.comm.collectives import Traffic


@dataclass
class StepStats:
    """What one optimizer step exchanged, as seen by this rank.

    ``dense_bytes``: the fp32 size of the gradients; ``payload_bytes``: what this rank
    contributed to collectives; ``sent_bytes``/``received_bytes``: what the ring algorithm
    moves per rank; ``compress_s``: time in memory and compressor math; ``communicate_s``:
    time inside collectives (on the exchange thread).
    """

    step: int
    tensors: int = 0
    dense_bytes: int = 0
    payload_bytes: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    collectives: int = 0
    compress_s: float = 0.0
    communicate_s: float = 0.0
    traffic: Traffic = field(default_factory=Traffic, repr=False)

    def close(self) -> None:
        """Take the byte and collective counts from :attr:`traffic` (the step is over)."""
        self.payload_bytes, self.sent_bytes = self.traffic.payload, self.traffic.sent
        self.received_bytes, self.collectives = self.traffic.received, self.traffic.collectives

    @property
    def compression_ratio(self) -> float:
        """Dense fp32 bytes over the bytes this rank actually contributed."""
        return self.dense_bytes / self.payload_bytes if self.payload_bytes else float("nan")

    def as_dict(self) -> dict[str, float | None]:
        """A flat dict for logs and strict JSON (``compression_ratio`` is ``None`` for a
        step that sent nothing, rather than NaN)."""
        return {
            "step": self.step,
            "tensors": self.tensors,
            "dense_bytes": self.dense_bytes,
            "payload_bytes": self.payload_bytes,
            "sent_bytes": self.sent_bytes,
            "received_bytes": self.received_bytes,
            "collectives": self.collectives,
            "compression_ratio": self.compression_ratio if self.payload_bytes else None,
            "compress_s": self.compress_s,
            "communicate_s": self.communicate_s,
        }
