"""Private random streams for the stochastic quantizers (TernGrad, QSGD).

Stochastic rounding must be independent across ranks, or the N ranks' rounding errors
coincide instead of averaging out, and reproducible, so that a resumed run draws what the
uninterrupted one would have. So each compressor owns one ``torch.Generator`` (never the
global RNG), seeded on first use from (seed option, compressor name, rank) on the device of
the tensors it rounds, and checkpoints its state together with the rank it belongs to.

Both also scale by a 2-norm, which :func:`l2_norm` computes without fp32's under- and
overflow of the squares.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.base import Compressor, Slot


def rank_seed(seed: int, stream: str, rank: int) -> int:
    """A 63-bit seed for ``rank``'s stream, the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b(f"{seed}|{stream}|{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RankStream:
    """One compressor's random stream on one rank, created lazily at the first draw.

    Args:
        seed: the compressor's ``seed`` option (the same on every rank).
        stream: a name that tells streams of different compressors apart.
    """

    def __init__(self, seed: int, stream: str) -> None:
        self.seed = seed
        self.stream = stream
        self.rank: int | None = None
        self.generator: torch.Generator | None = None

    def uniform_(self, out: Tensor, slot: Slot) -> Tensor:
        """Fill ``out`` with draws from U[0, 1) on ``slot.rank``'s stream; return it."""
        generator = self._generator_for(slot, out.device)
        if generator.device == out.device:
            return torch.rand(out.shape, generator=generator, out=out)
        return out.copy_(torch.rand(out.shape, generator=generator, device=generator.device))

    def words_(self, out: Tensor, slot: Slot) -> Tensor:
        """Fill the int64 tensor ``out`` with random 64-bit words (every bit a fair coin)
        from ``slot.rank``'s stream; return it."""
        generator = self._generator_for(slot, out.device)
        # from the lowest int64 to no bound: all 64 bits (random_() alone keeps the top one 0)
        if generator.device == out.device:
            return out.random_(-(2**63), None, generator=generator)
        drawn = torch.empty(out.shape, dtype=torch.int64, device=generator.device)
        return out.copy_(drawn.random_(-(2**63), None, generator=generator))

    def _generator_for(self, slot: Slot, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(rank_seed(self.seed, self.stream, slot.rank))
            self.rank = slot.rank
        elif slot.rank != self.rank:
            raise ValueError(
                f"{self.stream}: this random stream belongs to rank {self.rank} but was asked "
                f"to draw for rank {slot.rank}; every rank needs its own compressor and must "
                "load its own checkpoint (loading one rank's state on all ranks would make "
                "them round identically)"
            )
        return self.generator

    def state_dict(self) -> dict[str, Any]:
        """The generator's state, device and rank; empty before the first draw."""
        if self.generator is None:
            return {}
        return {
            "rank": self.rank,
            "device": str(self.generator.device),
            "state": self.generator.get_state().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream that :meth:`state_dict` recorded."""
        if not state:
            self.generator, self.rank = None, None
            return
        generator = torch.Generator(device=state["device"])
        generator.set_state(state["state"].clone())
        self.generator, self.rank = generator, int(state["rank"])


class StochasticCompressor(Compressor):
    """Base of compressors that round with their own :class:`RankStream` ``random``; the
    stream is their whole checkpoint state."""

    random: RankStream

    #: on a step refused on the device the stream moves on: it draws the rounding, which
    #: stays unbiased, and no state of the model or the memory
    undoes_on_device = True

    def state_dict(self) -> dict[str, Any]:
        """This rank's random stream, so that a resumed run draws the same numbers."""
        return {"random": self.random.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the random stream."""
        unknown = set(state) - {"random"}
        if unknown:
            raise ValueError(f"compressor {self.name!r} got unknown state {sorted(unknown)}")
        self.random.load_state_dict(state.get("random", {}))


#: Entries per partial sum in :func:`l2_norm`.
NORM_CHUNK = 4096


def l2_norm(flat: Tensor) -> Tensor:
    """``||flat||_2`` as a 0-d fp32 tensor, accurate for long, tiny and huge tensors.

    torch's fp32 norm of one long vector drifts (relative error 4e-4 at 10 M entries,
    1e-3 at 25 M, on CPU), so the squares are summed in rows of ``NORM_CHUNK`` entries
    (error about 1e-9) and the row norms combined in fp64, at the same speed. Squares of
    entries below about 1e-19 underflow fp32 and above 1e18 overflow, so a norm that comes
    out 0 or inf is recomputed from an fp64 copy (2x the memory, 20x the time, paid only
    in that rare case).
    """
    rows = flat.numel() // NORM_CHUNK
    body, tail = flat[: rows * NORM_CHUNK].view(rows, NORM_CHUNK), flat[rows * NORM_CHUNK :]
    parts = torch.cat(
        [torch.linalg.vector_norm(body, dim=1), torch.linalg.vector_norm(tail).reshape(1)]
    )
    norm = torch.linalg.vector_norm(parts.double())
    if not 1e-18 < float(norm) < 1e18:
        norm = torch.linalg.vector_norm(flat, dtype=torch.float64)
    return norm.float()


def check_seed(value: int) -> int:
    """Validate a ``seed`` option: an integer (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"seed must be an integer, got {value!r}")
    return value
