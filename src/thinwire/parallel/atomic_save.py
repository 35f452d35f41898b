"""A checkpoint folder written so that a run killed while saving leaves the last one whole.

``torch.distributed.checkpoint`` writes each rank's part and then the metadata straight
into the folder it is given: a run killed half-way leaves a folder that is neither the old
checkpoint nor the new one. Here every rank writes into a hidden sibling
(``.<name>.partial``); once all of them have, rank 0 syncs it to disk, moves the old
checkpoint aside (``.<name>.old``), renames the new one into place and removes the old.
Should the run die between those two renames, :func:`checkpoint_to_read` finds the old
one and says so. The folder must be on a file system every rank sees, as DCP needs.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from thinwire.errors import CheckpointError


def partial_of(path: Path) -> Path:
    """Where a checkpoint for ``path`` is written before it is complete."""
    return path.with_name(f".{path.name}.partial")


def retired_of(path: Path) -> Path:
    """Where the checkpoint at ``path`` waits while a newer one takes its place."""
    return path.with_name(f".{path.name}.old")


def save_atomically(write: Callable[[str], None], path: str | Path) -> None:
    """Have every rank ``write(folder)`` (a collective writer such as ``dcp.save``) into a
    temporary folder, then put it at ``path`` in place of any older checkpoint there.
    Collective over the default group: every rank raises if any step failed."""
    path = Path(path)
    partial = partial_of(path)
    _on_rank_zero(lambda: shutil.rmtree(partial, ignore_errors=True), path)  # a crash's
    try:
        write(str(partial))
    except CheckpointException as error:  # a BaseException: `except Exception` misses it
        raise CheckpointError(
            f"could not write the checkpoint at {path}: {describe_failures(error)}; the "
            "last checkpoint there is unchanged: free space or fix the folder, then save again"
        ) from None
    _on_rank_zero(lambda: _commit(partial, path), path)


def describe_failures(error: CheckpointException) -> str:
    """Which ranks DCP says failed, and the first one's error, in one line."""
    ranks = sorted(error.failures)
    first, _ = error.failures[ranks[0]]
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} failed ({first!r})"


def checkpoint_to_read(path: str | Path) -> Path:
    """The folder to read the checkpoint at ``path`` from: ``path``, or the checkpoint a
    save interrupted between its two renames left aside (with a warning)."""
    path = Path(path)
    retired = retired_of(path)
    if not path.exists() and retired.exists():
        warnings.warn(
            f"no checkpoint at {path}, but the one it replaced is at {retired} (a save was "
            "interrupted as it renamed the new one into place): resuming from it",
            stacklevel=3,
        )
        return retired
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: check the path")
    return path


def _commit(partial: Path, path: Path) -> None:
    """Sync ``partial`` to disk and rename it to ``path``, the old checkpoint aside first."""
    _sync_tree(partial)
    retired = retired_of(path)
    shutil.rmtree(retired, ignore_errors=True)
    if path.exists():
        os.replace(path, retired)
    os.replace(partial, path)
    _sync_folder(path.parent)
    shutil.rmtree(retired, ignore_errors=True)


def _sync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then the folders themselves."""
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())
        _sync_folder(Path(root))


def _sync_folder(folder: Path) -> None:
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _on_rank_zero(action: Callable[[], None], path: Path) -> None:
    """Run ``action`` on rank 0 and tell every rank how it went (none is left waiting)."""
    failure = None
    if dist.get_rank() == 0:
        try:
            action()
        except OSError as error:
            failure = f"{type(error).__name__}: {error}"
    box = [failure]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(
            f"could not write the checkpoint at {path} ({box[0]}); the last checkpoint "
            "there is unchanged: free space or fix the folder's permissions, then save again"
        )
