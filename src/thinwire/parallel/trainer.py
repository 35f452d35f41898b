"""The trainer :func:`thinwire.parallelize` returns: one optimizer step on a global batch,
evaluation, and the whole model's weights.

Every rank passes the same global batch; each data-parallel rank takes its slice (rank
``i`` of ``dp`` the ``i``-th of ``dp`` equal parts), the pipeline cuts it into micro-batches.
The loss returned (on every rank) is the global batch's mean: the mean over the slices of
each slice's mean over its micro-batches.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from thinwire.comm.agreement import ranks_differing
from thinwire.comm.collectives import group_timeout, run_collective
from thinwire.comm.transport import gather_bytes, is_transport_failure
from thinwire.data_parallel.local_steps import DiLoCo
from thinwire.errors import CommunicationError, RankMismatchError
from thinwire.parallel.checkpoint import collect_state, load_checkpoint, save_checkpoint
from thinwire.parallel.loss import LossFn
from thinwire.parallel.pipeline import Pipeline
from thinwire.parallel.plan import ParallelPlan
from thinwire.parallel.stages import StageModule, model_name
from thinwire.parallel.tied import TiedGradients


class ParallelTrainer:
    """Trains a model cut and sharded by a :class:`~thinwire.ParallelPlan`.

    Attributes:
        plan: the plan.
        mesh: the device mesh ``("pp", "dp", "tp")``.
        stages: the stage modules this rank runs (tensor-parallel shards under ``tp > 1``).
        optimizer: what is stepped (a :class:`~thinwire.DistributedOptimizer` when ``dp > 1``).

    ``thinwire.Checkpoints`` saves a trainer through :meth:`save` (DCP, resharded on load)
    into its step's folder, beside the other objects' per-rank files (``saves_sharded``).
    """

    #: :class:`thinwire.Checkpoints` writes it with :meth:`save` and reads it with :meth:`load`
    saves_sharded = True

    def __init__(
        self,
        plan: ParallelPlan,
        mesh: DeviceMesh,
        stages: Sequence[StageModule],
        pipeline: Pipeline,
        optimizer: torch.optim.Optimizer,
        loss: LossFn,
        tied: TiedGradients,
    ) -> None:
        self.plan, self.mesh, self.stages, self.tied = plan, mesh, list(stages), tied
        self.pipeline, self.optimizer, self.loss = pipeline, optimizer, loss
        self.steps = 0

    @property
    def engine(self):
        """The data-parallel exchange engine (``None`` when ``dp == 1``)."""
        return getattr(self.optimizer, "engine", None)

    def _slice(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(
                f"inputs hold {inputs.shape[0]} samples but targets {targets.shape[0]}: pass "
                "the same global batch of both"
            )
        self.plan.check_batch(inputs.shape[0])
        share = inputs.shape[0] // self.plan.dp
        start = self.mesh["dp"].get_local_rank() * share
        return inputs[start : start + share], targets[start : start + share]

    def step(self, inputs: Tensor, targets: Tensor) -> float:
        """One optimizer step on the global batch (the same on every rank); its mean loss.
        The first step checks that every rank was given the same batch."""
        if self.steps == 0:
            check_same_batch(inputs, targets)
        x, y = self._slice(inputs, targets)
        self.optimizer.zero_grad(set_to_none=True)
        for stage in self.stages:
            stage.train()
        with self._peers_alive(f"step {self.steps + 1}"):
            local = self.pipeline.train(x, y)
            self._shard_gradients()
            self.tied.sum_gradients()
            self.optimizer.step()
        self.steps += 1
        return self._global_mean(local)

    def _shard_gradients(self) -> None:
        """Lay each shard's gradient out as its parameter (a vocabulary-parallel
        embedding's comes back whole: keeping it so would hold, exchange and step ``tp``
        times the shard)."""
        for _, p in self.named_parameters():
            grad = p.grad
            if isinstance(grad, DTensor) and grad.placements != p.placements:
                p.grad = grad.redistribute(p.device_mesh, p.placements)

    def evaluate(self, inputs: Tensor, targets: Tensor) -> float:
        """The global batch's mean loss, without gradients or a step."""
        x, y = self._slice(inputs, targets)
        for stage in self.stages:
            stage.eval()
        with self._peers_alive("evaluation"):
            local = self.pipeline.evaluate(x, y)
        return self._global_mean(local)

    @contextlib.contextmanager
    def _peers_alive(self, what: str) -> Iterator[None]:
        """Turn a failed pipeline send or tensor-parallel collective (a peer died, stalled
        or diverged) into a :class:`CommunicationError` that says so."""
        try:
            yield
        except RuntimeError as error:
            if not is_transport_failure(error):
                raise
            raise CommunicationError(
                f"{what} failed on rank {dist.get_rank()} under the plan {self.plan} (process "
                f"group timeout: {group_timeout(None)}): a pipeline or tensor-parallel peer has "
                f"probably died, stalled or run a different step; check the other ranks' "
                f"output. ({error})"
            ) from error

    def _global_mean(self, local: Tensor | None) -> float:
        """The mean over the data-parallel slices of the last stage's losses, on every rank
        (one all-reduce of one number)."""
        counts = local is not None and self.mesh["tp"].get_local_rank() == 0
        value = torch.tensor([float(local) if counts else 0.0], dtype=torch.float64)
        run_collective("the loss all-reduce", dist.all_reduce, value)
        return float(value) / self.plan.dp

    def full_state_dict(self) -> dict[str, Tensor]:
        """Every parameter and buffer whole, named as in the model given to ``parallelize``,
        the same dict on every rank. Collective: every rank calls it."""
        own: dict[str, Tensor] = {}
        for stage in self.stages:
            for name, value in stage.state_dict().items():
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                own[model_name(name)] = value.detach().clone()
        keeps = self.mesh["dp"].get_local_rank() == 0 and self.mesh["tp"].get_local_rank() == 0
        buffer = io.BytesIO()
        if keeps:
            torch.save(own, buffer)
        merged: dict[str, Tensor] = {}
        for data in gather_bytes(buffer.getvalue(), None, "gathering the full state dict"):
            if data:
                merged.update(torch.load(io.BytesIO(data), weights_only=True))
        return merged

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters (shards under tensor parallelism), named as the model
        given to ``parallelize`` names them."""
        return [(model_name(n), p) for stage in self.stages for n, p in stage.named_parameters()]

    @property
    def local_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over this rank's parameters (inside the data-parallel wrapper)."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a ``torch.distributed.checkpoint`` state dict: weights and
        optimizer state keyed by the model's names (``DTensor`` shards under tensor
        parallelism), the step count, the plan, thinwire's exchange state."""
        return collect_state(
            self.named_parameters(),
            self.local_optimizer,
            self._exchange_state(),
            self.plan,
            self.steps,
        )

    def _exchange_state(self) -> Any:
        """What holds the data-parallel exchange's state: DiLoCo's rounds (the global
        weights, the outer momentum, the residuals), else the engine. A DiLoCo round must
        have ended: until then the dp replicas' weights differ, and a checkpoint keeps one."""
        if isinstance(self.optimizer, DiLoCo):
            if not self.optimizer.synced:
                raise RuntimeError(
                    f"a checkpoint of a {self.plan.dp_method} plan is taken when a round has "
                    f"ended (every sync_every={self.optimizer.sync_every} steps; "
                    f"{self.optimizer.inner_steps} taken), when every dp replica holds the "
                    "same weights: save then, or call trainer.optimizer.flush() first"
                )
            return RoundsState(self.optimizer)
        return self.engine

    def save(self, path: str | Path) -> None:
        """Write a checkpoint to the directory ``path`` that any plan can resume from.
        Collective: every rank calls it."""
        save_checkpoint(self.state_dict(), path)

    def load(self, path: str | Path) -> None:
        """Resume from the checkpoint at ``path``, written under this plan or another (the
        weights and optimizer state are resharded). Collective: every rank calls it."""
        self.steps = load_checkpoint(
            path,
            self.named_parameters(),
            self.local_optimizer,
            RoundsState(self.optimizer) if isinstance(self.optimizer, DiLoCo) else self.engine,
            self.plan,
        )

    def close(self) -> None:
        """Stop the exchange thread (the trainer is unusable afterwards). The mesh's
        groups stay until ``dist.destroy_process_group()``: DTensor caches layouts by the
        mesh's shape, so a later mesh of the same shape may still name this one's groups."""
        if isinstance(self.optimizer, DiLoCo):
            self.optimizer.close()
        elif self.engine is not None:
            self.engine.close()


class RoundsState:
    """DiLoCo's state as a trainer's checkpoint holds it: without the inner optimizer's,
    which the checkpoint keeps resharded by name."""

    def __init__(self, rounds: DiLoCo) -> None:
        self.rounds = rounds

    def state_dict(self) -> dict[str, Any]:
        """The rounds' state less the inner optimizer's."""
        return self.rounds.state_dict(with_inner=False)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.rounds.load_state_dict(state, with_inner=False)


def check_same_batch(inputs: Tensor, targets: Tensor) -> None:
    """Raise :class:`RankMismatchError` on every rank if the ranks' global batches differ
    (one all-gather of a digest)."""
    fact = hashlib.sha1(inputs.detach().cpu().numpy().tobytes())
    fact.update(targets.detach().cpu().numpy().tobytes())
    (differing,) = ranks_differing([fact.hexdigest()], None)
    if differing:
        raise RankMismatchError(
            f"rank {dist.get_rank()} and rank(s) {', '.join(map(str, differing))} were given "
            "different global batches: every rank must pass the same batch to step() (the "
            "trainer gives each data-parallel rank its slice); sample it from a generator "
            "seeded by the step, as thinwire.tasks' global_batch() does"
        )
