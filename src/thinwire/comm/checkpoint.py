"""Exchange state in checkpoints: whose a state is, and one object for every rank's state.

Residuals, momenta and warm starts are each rank's own, so :meth:`GradientExchange.state_dict`
describes one rank and names it (``owner``). Frameworks (Lightning, Accelerate, the
Hugging Face ``Trainer``) write only rank 0's copy of a checkpoint, so a per-rank state
would be lost for every other rank. :func:`gather_states` therefore collects every rank's
state into one *all-ranks* object, equal on every rank, that any rank can save; on resume
each rank takes its own part (:func:`own_part`). Each part travels and is kept as the bytes
of ``torch.save``, so a rank decodes only its own.

The object's ``origin`` (a digest of every part) names the checkpoint: ranks that resumed
from it share it, which lets the engine check at its first exchange that every rank
resumed from the same checkpoint, or none did (:func:`check_same_start`).
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.agreement import value_ranges
from thinwire.comm.saved_options import same_compressor
from thinwire.comm.transport import gather_bytes
from thinwire.errors import RankMismatchError

#: the ``format`` of an all-ranks state
ALL_RANKS = "thinwire.all-ranks/1"


def gather_states(state: dict[str, Any], group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Every rank's ``state`` in one object (the same on every rank). Collective."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    parts = gather_bytes(buffer.getvalue(), group, what="gathering thinwire's state")
    digest = hashlib.sha1(b"".join(parts)).digest()
    return {
        "format": ALL_RANKS,
        "world_size": len(parts),
        "origin": int.from_bytes(digest[:8], "little") >> 2,  # 62 bits: negation stays int64
        "ranks": [torch.frombuffer(bytearray(part), dtype=torch.uint8) for part in parts],
    }


def is_all_ranks(state: Any) -> bool:
    """Whether ``state`` is what :func:`gather_states` returns."""
    return isinstance(state, dict) and state.get("format") == ALL_RANKS


def own_part(state: dict[str, Any], rank: int, world_size: int) -> tuple[dict[str, Any], int]:
    """This rank's state in an all-ranks object, and the object's origin."""
    saved = int(state.get("world_size", -1))
    if saved != world_size or len(state.get("ranks", ())) != saved:
        raise ValueError(
            f"this thinwire checkpoint holds the state of {saved} ranks, and this job has "
            f"{world_size}: residuals, momenta and warm starts are each rank's own, so a "
            f"state resumes only on {saved} ranks. To resume on {world_size}, leave the "
            "thinwire state out of the resume (the compressor then starts fresh on every rank)."
        )
    part = state["ranks"][rank]
    mine = torch.load(io.BytesIO(part.numpy().tobytes()), weights_only=True, map_location="cpu")
    return mine, int(state["origin"])


def owner_of(rank: int, world_size: int, compressor: str, memory: str) -> dict[str, Any]:
    """The ``owner`` entry a state is saved with."""
    return {"rank": rank, "world_size": world_size, "compressor": compressor, "memory": memory}


def check_owner(
    state: dict[str, Any], mine: dict[str, Any], defaults: dict[str, str] | None = None
) -> None:
    """Raise ``ValueError`` saying what to do unless ``state`` was saved by the owner
    ``mine`` (this rank of a job of this size, with the same compressor and memory; a
    compressor saved before an option was added matches where this run leaves it at its
    default, from ``defaults``: :mod:`thinwire.comm.saved_options`). (States saved
    before thinwire recorded an owner are taken as they are.)"""
    missing = {"step", "compressor", "memory"} - set(state)
    if missing:
        raise ValueError(f"not a thinwire exchange state: missing {sorted(missing)}")
    owner = state.get("owner")
    if owner is None:
        return
    for key in ("compressor", "memory"):
        saved = owner.get(key)
        if key == "compressor" and isinstance(saved, str):
            matches = same_compressor(saved, mine[key], defaults or {})
        else:
            matches = saved == mine[key]
        if not matches:
            raise ValueError(
                f"this thinwire state was saved with {key} {owner.get(key)}, but this "
                f"exchange uses {mine[key]}: build thinwire with the same compressor "
                "options as the saved run, or resume without the thinwire state (the "
                "compressor then starts fresh)"
            )
    if (owner.get("rank"), owner.get("world_size")) != (mine["rank"], mine["world_size"]):
        raise ValueError(
            f"this thinwire state is rank {owner.get('rank')}'s of {owner.get('world_size')}"
            f", and this is rank {mine['rank']} of {mine['world_size']}: residuals, momenta "
            "and warm starts are each rank's own. Save engine.full_state_dict() (every "
            "rank's state in one object; call it on every rank) and load that on every "
            "rank, or save each rank's state_dict() to its own file (ckpt-rank{rank}.pt) "
            "and load that one. To resume on another number of ranks, resume without the "
            "thinwire state."
        )


def check_same_start(step: int, origin: int, rank: int, group: dist.ProcessGroup | None) -> None:
    """Raise :class:`RankMismatchError` on every rank unless every rank starts exchanging
    at the same step from the same checkpoint (``origin``: 0 for none, or for per-rank
    states). Collective: one small all-reduce."""
    (low_step, high_step), (low_origin, high_origin) = value_ranges([step, origin], group)
    if low_step == high_step and low_origin == high_origin:
        return
    resumed = "resumed from a checkpoint" if origin else "did not resume from an all-ranks one"
    raise RankMismatchError(
        f"the ranks start at different points: their steps range over {low_step}..{high_step} "
        f"and not all resumed from the same thinwire checkpoint (rank {rank} is at step {step} "
        f"and {resumed}). Ranks that train on from different error-feedback states drift "
        "apart silently, so no rank exchanged anything. Load the same thinwire state on "
        "every rank (engine.full_state_dict() saves every rank's in one object), or on none."
    )
