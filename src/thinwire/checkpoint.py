"""Checkpoints a restarted job resumes from exactly: numbered, per rank, written atomically.

    checkpoints = thinwire.Checkpoints("ckpt", keep=2)
    start = checkpoints.restore(model=model, optimizer=opt, thinwire=engine)  # 0: none yet
    for step in range(start, steps):
        ...  # forward, backward, step
        if (step + 1) % 50 == 0:
            checkpoints.save(step + 1, model=model, optimizer=opt, thinwire=engine)

Every object with ``state_dict()``/``load_state_dict()`` can be named: the model, its
optimizer, and whatever thinwire front end holds state (the DDP hook's engine,
``DistributedOptimizer``, ``DelayedAveraging`` (flushed first), ``DiLoCo``,
``ParameterServer``; sparse embedding tables through the model and its optimizer).
A ``ParallelTrainer`` is written through its own ``save`` (DCP, atomic, resharded when
loaded) into the step's folder, ``step-00000050/<name>/`` (so the folder must then be on a
file system every rank sees, as DCP needs). thinwire's state is
per rank (error feedback, momenta, warm starts, shards), so each rank writes its own file,
``step-00000050/rank-00003.pt``, and beside it a record ``rank-00003.json`` of its size and
SHA-256. Both are written under temporary names, flushed to disk and renamed into place,
the record last: a save interrupted at any point leaves no record, and the checkpoint before
it stays the newest complete one. Random generator states (Python, NumPy, torch, CUDA) are
saved with the rest, so resumed steps draw what uninterrupted ones would have drawn.

:meth:`Checkpoints.restore` resumes from the newest step that *every* rank holds complete
(agreed by collectives, so hosts need not share a file system). A file whose size or digest
disagrees with its record (truncated, overwritten) is skipped with a warning there, and
refused when asked for by step; a checkpoint of another world size, rank or set of objects
is refused with a :class:`CheckpointError` before anything is loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from thinwire.errors import CheckpointError

FORMAT = "thinwire-checkpoint-1"
STEP_DIR = re.compile(r"^step-(\d{8})$")


def _step_dir(step: int) -> str:
    return f"step-{step:08d}"


def _rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either its old content or all of
    ``data``, never a part: a temporary file in the same folder, flushed to disk, renamed."""
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the platform allows opening folders)."""
    with contextlib.suppress(OSError):
        handle = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def rng_state() -> dict[str, Any]:
    """The random generators' states: Python's, NumPy's, torch's and, if present, CUDA's."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def warn_if_restarts_share_a_store() -> None:
    """Warn when torchrun may restart this job while its workers share its rendezvous
    store: a restarted gloo group can then read the address of a worker of the attempt
    before, fail to connect, and fail every restart the same way (pytorch/pytorch#167288)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        warnings.warn(
            "thinwire: torchrun may restart this job (--max-restarts "
            f"{restarts}), and its workers share its rendezvous store: a restarted process "
            "group can read a dead worker's address from it and fail to connect. Launch "
            "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment and a c10d "
            "rendezvous (--standalone on one machine, --rdzv-backend c10d on several)",
            stacklevel=3,
        )


def _flush_pending(obj: Any) -> None:
    """Delayed averaging's weights are agreed only after its corrections land: flush first
    (collective; every rank saves at the same step)."""
    from thinwire.data_parallel.delayed import DelayedAveraging

    if isinstance(obj, DelayedAveraging) and obj.pending:
        obj.flush()


def _own_state(obj: Any) -> Any:
    """What this rank's file keeps of ``obj``: its state, or for an object that saves
    itself sharded (``saves_sharded``: a hybrid-parallel trainer, through DCP into the
    step's folder), only that it did."""
    return {"saved_sharded": True} if getattr(obj, "saves_sharded", False) else obj.state_dict()


class Checkpoints:
    """Numbered per-rank checkpoints in ``directory`` (see the module's description).

    ``keep``: how many complete checkpoints each rank keeps (older ones are removed after a
    save that every rank completed). ``group``: the process group whose ranks save and
    restore together (the default group; without an initialised process group, one rank).
    ``save`` and ``restore`` are collective: every rank of the group calls them, at the same
    step.
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int = 2, group: Any = None) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer (checkpoints kept), got {keep!r}")
        self.directory = Path(directory)
        self.keep = keep
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        self.world = dist.get_world_size(group) if distributed else 1
        self._distributed = distributed
        if self.rank == 0:
            warn_if_restarts_share_a_store()

    # -- saving ---------------------------------------------------------------------------

    def save(self, step: int, **objects: Any) -> Path:
        """Write this rank's checkpoint of ``objects`` (name: anything with ``state_dict()``)
        at ``step``; return its file. Collective. When every rank has written, checkpoints
        beyond the newest ``keep`` are removed. Raises :class:`CheckpointError` on every rank
        if any rank could not write (the previous checkpoint stays the newest)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if not objects:
            raise ValueError("save() needs the objects to save, e.g. save(step, model=model)")
        self._check_objects(objects)
        for obj in objects.values():
            _flush_pending(obj)
        folder = self.directory / _step_dir(step)
        for name, obj in objects.items():  # collective, each its own atomic folder
            if getattr(obj, "saves_sharded", False):
                obj.save(folder / name)
        payload = {
            "format": FORMAT,
            "step": step,
            "rank": self.rank,
            "world": self.world,
            "types": {name: type(obj).__name__ for name, obj in objects.items()},
            "states": {name: _own_state(obj) for name, obj in objects.items()},
            "rng": rng_state(),
        }
        target = folder / f"{_rank_name(self.rank)}.pt"
        failure: BaseException | None = None
        try:
            buffer = io.BytesIO()
            torch.save(payload, buffer)
            data = buffer.getvalue()
            folder.mkdir(parents=True, exist_ok=True)
            write_atomically(target, data)
            record = {
                "format": FORMAT,
                "step": step,
                "rank": self.rank,
                "world": self.world,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "objects": sorted(objects),
            }
            write_atomically(folder / f"{_rank_name(self.rank)}.json", json.dumps(record).encode())
        except Exception as error:  # every rank must hear of it, or the others would hang
            failure = error
        failed = self._ranks_failing(failure is not None)
        if failed:
            raise CheckpointError(
                f"the checkpoint of step {step} in {self.directory} was not written by rank(s) "
                f"{failed}" + (f" (here: {failure})" if failure else "") + "; the previous "
                "checkpoint stays the newest. Check the disk space and permissions there (and "
                "that every object's state_dict() can be pickled)."
            ) from failure
        committed = folder / f"{_rank_name(self.rank)}.committed"
        write_atomically(committed, b"")  # every rank wrote its part of this step
        self._prune()
        return target

    def _ranks_failing(self, failed_here: bool) -> list[int]:
        """Which ranks of the group report a failure (collective)."""
        if not self._distributed:
            return [self.rank] if failed_here else []
        flags = torch.zeros(self.world, dtype=torch.int32)
        flags[self.rank] = int(failed_here)
        dist.all_reduce(flags, group=self.group)
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]

    def _prune(self) -> None:
        """Remove this rank's files of complete checkpoints beyond the newest ``keep``, and
        of interrupted saves older than the newest complete one. Other ranks prune the same
        folders at the same time (on a shared file system): what is gone is skipped, and a
        failure to remove only warns (the new checkpoint is written)."""
        try:
            complete = self.committed_steps()
            if not complete:
                return
            kept = set(complete[-self.keep :])
            mine = (f"{_rank_name(self.rank)}.", f".{_rank_name(self.rank)}.")
            for step, folder in self._folders():
                if step in kept or step > complete[-1]:
                    continue
                try:
                    names = [entry.name for entry in os.scandir(folder)]
                except FileNotFoundError:
                    continue
                for name in names:
                    if name.startswith(mine):
                        with contextlib.suppress(FileNotFoundError):
                            (folder / name).unlink()
                    elif self.rank == 0 and not name.startswith(("rank-", ".rank-")):
                        shutil.rmtree(folder / name, ignore_errors=True)  # a sharded save
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only when no other rank's files remain
        except OSError as error:
            warnings.warn(
                f"thinwire: old checkpoints in {self.directory} could not be removed ({error})",
                stacklevel=3,
            )

    # -- finding ----------------------------------------------------------------------------

    def _folders(self) -> list[tuple[int, Path]]:
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = STEP_DIR.match(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def _record(self, step: int) -> dict[str, Any] | None:
        path = self.directory / _step_dir(step) / f"{_rank_name(self.rank)}.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("format") == FORMAT else None

    def _records(self) -> dict[int, dict[str, Any]]:
        """This rank's records of finished saves, by step (oldest first)."""
        records = {step: self._record(step) for step, _ in self._folders()}
        return {step: record for step, record in records.items() if record is not None}

    def local_steps(self) -> list[int]:
        """Steps for which this rank holds a record of a finished save (oldest first); the
        files are verified when loaded."""
        return list(self._records())

    def committed_steps(self) -> list[int]:
        """Steps this rank saw every rank finish saving (a save's last act, oldest first)."""
        name = f"{_rank_name(self.rank)}.committed"
        return [step for step, folder in self._folders() if (folder / name).exists()]

    def _verified(self, step: int) -> tuple[bytes | None, str]:
        """This rank's file of ``step`` if it matches its record, else ``None`` and why."""
        record = self._record(step)
        where = self.directory / _step_dir(step) / f"{_rank_name(self.rank)}.pt"
        if record is None:
            return None, f"{where} has no record of a finished save (interrupted or missing)"
        try:
            data = where.read_bytes()
        except OSError as error:
            return None, f"{where} cannot be read ({error})"
        if len(data) != record.get("bytes") or hashlib.sha256(data).hexdigest() != record.get(
            "sha256"
        ):
            return None, (
                f"{where} is {len(data)} bytes and does not match its record "
                f"({record.get('bytes')} bytes, sha256 {str(record.get('sha256'))[:12]}...): "
                "truncated or overwritten"
            )
        return data, ""

    def _agreed(self, candidates: list[int]) -> tuple[int | None, bytes | None]:
        """The newest of ``candidates`` (the same list on every rank) whose file verifies
        on every rank, with this rank's bytes (collective)."""
        for step in sorted(candidates, reverse=True):
            data, why = self._verified(step)
            failed = self._ranks_failing(data is None)
            if not failed:
                return step, data
            if data is None:
                warnings.warn(
                    f"thinwire: skipping the checkpoint of step {step}: {why}", stacklevel=3
                )
        return None, None

    def _common_steps(self) -> list[int]:
        """Steps every rank holds a record of (collective); refuses, on every rank, a
        directory that some rank finds written by a job of another world size."""
        records = self._records()
        mine = list(records)
        worlds = {record.get("world") for record in records.values()} - {self.world}
        mine_all = (mine, sorted(worlds), self.committed_steps())
        everyone: list[Any] = [mine_all]
        if self._distributed:
            everyone = [None] * self.world
            dist.all_gather_object(everyone, mine_all, group=self.group)
        foreign = sorted({w for _, ws, _ in everyone for w in ws})
        if foreign:
            raise CheckpointError(
                f"{self.directory} holds checkpoints of a job of {foreign} ranks, this one has "
                f"{self.world}: thinwire's per-rank state (error feedback, momenta, shards) "
                "resumes only on as many ranks. Restart with that world size, or point "
                "Checkpoints at another directory to start afresh"
            )
        common = set(mine)
        for steps, _, _ in everyone:
            common &= set(steps)
        committed = [step for _, _, steps in everyone for step in steps]
        if committed and max(committed) not in common:
            newest = max(committed)
            lacking = [r for r, (steps, _, _) in enumerate(everyone) if newest not in steps]
            raise CheckpointError(
                f"every rank finished saving step {newest} in {self.directory}, but rank(s) "
                f"{lacking} cannot find their part of it there now: resuming elsewhere would "
                "lose progress. Keep the checkpoints on a file system every rank sees (or each "
                "rank on the machine that holds its files), then restart"
            )
        return sorted(common)

    # -- restoring --------------------------------------------------------------------------

    def restore(self, step: int | None = None, **objects: Any) -> int:
        """Load the newest checkpoint every rank holds complete (or ``step``'s) into
        ``objects`` (the names used to save) and the random generators; return its step, or
        0 when there is none yet (nothing is loaded). Collective."""
        if not objects:
            raise ValueError("restore() needs the objects to load, e.g. restore(model=model)")
        self._check_objects(objects)
        common = self._common_steps()
        if step is not None:
            if step not in common:
                raise CheckpointError(
                    f"no complete checkpoint of step {step} on every rank in {self.directory} "
                    f"(complete on every rank: {common or 'none'})"
                )
            data, why = self._verified(step)
            failed = self._ranks_failing(data is None)
            if failed:
                raise CheckpointError(
                    f"the checkpoint of step {step} is damaged on rank(s) {failed}"
                    + (f" (here: {why})" if why else "")
                    + "; restore() without a step takes the newest good one"
                )
        else:
            step, data = self._agreed(common)
            if step is None:
                return 0
        payload = self._payload(data, step)
        self._check_identity(payload, objects, step)
        loaded: list[str] = []
        for name, obj in objects.items():
            if getattr(obj, "saves_sharded", False):  # collective: every rank, same order
                obj.load(self.directory / _step_dir(step) / name)
                loaded.append(name)
                continue
            try:
                obj.load_state_dict(payload["states"][name])
            except Exception as error:
                partly = f" ({', '.join(loaded)} already loaded: rebuild them)" if loaded else ""
                raise CheckpointError(
                    f"the checkpoint of step {step} does not fit {name!r} "
                    f"({type(obj).__name__}): {error}{partly}"
                ) from error
            loaded.append(name)
        set_rng_state(payload["rng"])
        return int(step)

    def _payload(self, data: bytes | None, step: int) -> dict[str, Any]:
        try:  # the user's own files (verified against their records): full unpickling
            payload = torch.load(io.BytesIO(data or b""), weights_only=False)
        except Exception as error:
            raise CheckpointError(
                f"the checkpoint of step {step} in {self.directory} cannot be read: {error}"
            ) from error
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise CheckpointError(
                f"the file of step {step} in {self.directory} is not a thinwire checkpoint"
            )
        return payload

    def _check_identity(self, payload: dict[str, Any], objects: Mapping[str, Any], step: int):
        problems = []
        if payload["rank"] != self.rank or payload["world"] != self.world:
            problems.append(
                f"it is rank {payload['rank']} of {payload['world']}'s, this is rank "
                f"{self.rank} of {self.world}"
            )
        saved = payload["types"]
        if set(saved) != set(objects):
            problems.append(f"it holds {sorted(saved)}, restore() was given {sorted(objects)}")
        else:
            problems += [
                f"{name!r} was a {saved[name]}, now a {type(obj).__name__}"
                for name, obj in objects.items()
                if saved[name] != type(obj).__name__
            ]
        if problems:
            raise CheckpointError(
                f"the checkpoint of step {step} in {self.directory} belongs to another setup: "
                f"{'; '.join(problems)}. Nothing was loaded: restore with the setup that saved "
                "it, or point Checkpoints at another directory"
            )

    @staticmethod
    def _check_objects(objects: Mapping[str, Any]) -> None:
        for name, obj in objects.items():
            if getattr(obj, "saves_sharded", False):
                continue  # saved and loaded through its own save(path) and load(path)
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"{name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict(): "
                    "name only models, optimizers and thinwire front ends"
                )
