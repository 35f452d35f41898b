"""The parameter server front end: ``thinwire.ParameterServer``.

    ps = thinwire.ParameterServer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                  "dgc", mode="async", staleness=2, servers=1)
    if ps.is_worker:
        for x, y in batches:
            loss_fn(model(x), y).backward(); ps.step(); ps.zero_grad()
    ps.close()          # every rank; a dedicated server rank serves until the workers close

    state = ps.state_dict()          # every rank, at the same step: a checkpoint
    ps.load_state_dict(state)        # in a new job, right after building the server

Ranks ``0 .. servers-1`` each own one shard of the parameters (balanced by size). With
``colocated=True`` (the default) every rank is a worker and the server ranks run their
shard in a background thread; with ``colocated=False`` the server ranks only serve and the
other ranks are the workers.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire.comm import shutdown
from thinwire.comm.agreement import parameter_layout, ranks_differing
from thinwire.comm.collectives import group_timeout, run_collective
from thinwire.comm.engine import GradientExchange, GradientItem
from thinwire.comm.gradients import gradient_of
from thinwire.compress.base import Compressor, Memory, is_integer, is_real
from thinwire.compress.registry import compressor as build_compressor
from thinwire.data_parallel.optimizer import check_first_order
from thinwire.data_parallel.parameter_server.channels import (
    TO_SERVER,
    TO_WORKER,
    Channel,
    LocalPair,
    ProcessChannel,
)
from thinwire.data_parallel.parameter_server.links import ServerLink
from thinwire.data_parallel.parameter_server.server import (
    ANSWER,
    CLOSE,
    FINE,
    PUSH,
    SNAPSHOT,
    ShardServer,
    base_rate,
)
from thinwire.data_parallel.parameter_server.sharding import assign_shards, wire_dtype
from thinwire.data_parallel.parameters import ignored_names, is_table, split_parameters
from thinwire.errors import CommunicationError, NonFiniteGradientError, RankMismatchError

MODES = ("sync", "async")


class ParameterServer:
    """Data parallelism through a sharded parameter server.

    Workers push (compressed) gradients, the server shards decode, average and apply them
    with their own copy of the optimizer, and the workers pull the new parameters.
    ``mode="sync"`` averages one push from every worker per step (all-reduce SGD);
    ``mode="async"`` applies each push alone and lets a worker run at most ``staleness``
    steps ahead of the slowest one.

    Args:
        optimizer: an optimizer over the model's parameters; the servers build the same
            class with the same parameter-group settings over their shard (the workers
            never step it). A learning-rate schedule set on it travels with each push.
        model: the model, or an iterable of ``(name, parameter)`` pairs.
        compressor: a registered name or a :class:`Compressor` (options in ``**options``).
        mode: ``"sync"`` or ``"async"``.
        servers: K, the number of server shards (ranks ``0 .. K-1``).
        colocated: servers run as threads inside worker ranks (True), or are ranks of
            their own (False: the workers are ranks ``K ..``).
        staleness: tau for ``mode="async"``: an integer >= 0.
        memory: override the compressor's default error-feedback memory.
        group: the process group; default: the global one.
        timeout_s: how long to wait for a message before raising
            :class:`~thinwire.CommunicationError` (default: the group's timeout).
        **options: compressor options when ``compressor`` is a name.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Iterable[tuple[str, nn.Parameter]],
        compressor: str | Compressor = "none",
        *,
        mode: str = "sync",
        servers: int = 1,
        colocated: bool = True,
        staleness: int = 1,
        memory: Memory | None = None,
        group: dist.ProcessGroup | None = None,
        timeout_s: float | None = None,
        **options: Any,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call "
                "torch.distributed.init_process_group(...) first (or launch with torchrun)"
            )
        check_first_order(optimizer)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not is_integer(staleness) or staleness < 0:
            raise ValueError(f"staleness must be an integer >= 0 (steps), got {staleness!r}")
        staleness = int(staleness)
        if timeout_s is not None and not (is_real(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        if not base_rate(optimizer.param_groups[0]) > 0:
            raise ValueError(
                "the parameter server sends each push's learning rate as a factor of the "
                "optimizer's rate at construction (its first group's initial_lr or lr), "
                f"which is {base_rate(optimizer.param_groups[0])!r}: build the optimizer with "
                "its peak rate (a scheduler may then lower it, to 0 too) before the server"
            )
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if not is_integer(servers) or servers < 1:
            raise ValueError(f"servers must be an integer >= 1, got {servers!r}")
        servers = int(servers)
        if servers > world or (not colocated and servers >= world):
            raise ValueError(
                f"{servers} server(s) in a world of {world} rank(s) leaves no "
                f"{'room' if colocated else 'worker'}: use fewer servers"
                + ("" if colocated else " or colocated=True")
            )
        named = list(model.named_parameters() if isinstance(model, nn.Module) else model)
        tables = [name for name, p in named if is_table(p)]
        left_alone = sorted(ignored_names(model) | set(tables))
        if left_alone:
            raise ValueError(
                f"the model tells data-parallel wrappers to leave {', '.join(left_alone[:3])}"
                f"{' ...' if len(left_alone) > 3 else ''} alone (thinwire.data_parallel.sparse "
                "tables, or DDP's ignore list), but a parameter server trains every parameter on "
                "its shards. Convert the tables back with "
                "thinwire.data_parallel.sparse.dense_embeddings(model), "
                "or train a model with sparse tables under DDP or DistributedOptimizer"
            )
        self.parameters, _ = split_parameters(named)
        if not self.parameters:
            raise ValueError("the model has no parameters that require gradients")
        built = build_compressor(compressor, **options)
        built.check_optimizer(optimizer)
        self.mode, self.staleness, self.servers = mode, staleness, servers
        self.optimizer = optimizer
        self.rank, self.world = rank, world
        self.colocated = colocated
        self.first_worker = 0 if colocated else servers
        self.workers = world - self.first_worker
        self.is_server = rank < servers
        self.is_worker = rank >= self.first_worker
        self.worker_index = rank - self.first_worker
        pg_timeout = group_timeout(group) or datetime.timedelta(minutes=30)
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else pg_timeout
        self.timeout = timeout
        self.shards = assign_shards(self.parameters, servers)
        self._check_agreement(built, group, colocated)
        with torch.no_grad():  # every rank starts from rank 0's parameters
            root = dist.get_global_rank(group, 0) if group is not None else 0
            for _, p in self.parameters:
                run_collective(
                    "the broadcast of rank 0's parameters",
                    dist.broadcast,
                    p.data,
                    src=root,
                    group=group,
                )

        local_ends: dict[int, Channel] = {}
        self._local: LocalPair | None = None
        self.server: ShardServer | None = None
        self._server_error: BaseException | None = None
        self._server_thread: threading.Thread | None = None
        if self.is_server:
            channels: list[Channel] = []
            for worker_rank in range(self.first_worker, world):
                if worker_rank == rank:
                    self._local = LocalPair(timeout.total_seconds())
                    local_ends[rank] = self._local.worker_end
                    channels.append(self._local.server_end)
                else:
                    channels.append(
                        ProcessChannel(worker_rank, TO_WORKER, TO_SERVER, group, timeout)
                    )
            self.server = self._build_server(built, channels, options)
            if colocated:
                self._server_thread = threading.Thread(
                    target=self._serve_in_background, name="thinwire-ps-server", daemon=True
                )
                self._server_thread.start()

        self._links: list[ServerLink] = []
        self._engines: list[GradientExchange] = []
        self._versions = [0] * servers
        self.step_count = 0
        self._closed = False
        self._served = False
        if self.is_worker:
            world_size = self.workers if mode == "sync" else 1
            for server_rank in range(servers):
                channel = local_ends.get(server_rank) or ProcessChannel(
                    server_rank, TO_SERVER, TO_WORKER, group, timeout
                )
                link = ServerLink(channel, world_size, self.worker_index, built.rounds > 1)
                self._links.append(link)
                self._engines.append(GradientExchange(built, communicator=link, memory=memory))
        self._base_lr = base_rate(optimizer.param_groups[0])
        shutdown.register(self, group)  # closed, if not by the user, before its group goes

    # -- construction helpers -----------------------------------------------------------

    def _check_agreement(self, compressor: Compressor, group: Any, colocated: bool) -> None:
        setup = f"{compressor!r}|{self.mode}|{self.staleness}|{self.servers}|{colocated}"
        layouts, setups = ranks_differing([parameter_layout(self.parameters), setup], group)
        problems = [f"rank {r} has different parameters (names, shapes or dtypes)" for r in layouts]
        problems += [
            f"rank {r} has a different compressor or server setup"
            for r in setups
            if r not in layouts
        ]
        if problems:
            raise RankMismatchError(
                f"ranks disagree (seen from rank {self.rank}): {'; '.join(problems)}. Every "
                "rank must build the same model and ParameterServer(...) with the same options."
            )

    def _build_server(
        self, compressor: Compressor, channels: list[Channel], options: dict[str, Any]
    ) -> ShardServer:
        shard = self.shards[self.rank]
        owned = {id(self.parameters[i][1]): i for i in shard}
        groups, names = [], []
        for group in self.optimizer.param_groups:
            params = []
            for p in group["params"]:
                if id(p) in owned:
                    params.append(p.detach().clone())
                    names.append(self.parameters[owned[id(p)]][0])
            if params:
                groups.append(
                    {**{k: v for k, v in group.items() if k != "params"}, "params": params}
                )
        if len(names) != len(shard):
            raise ValueError(
                "some parameters that require gradients are in no optimizer parameter group; "
                "give the optimizer every parameter of the model"
            )
        optimizer = type(self.optimizer)(groups, **self.optimizer.defaults)
        return ShardServer(
            names, optimizer, _copy_compressor(compressor), channels, self.mode, self.staleness
        )

    def _serve_in_background(self) -> None:
        assert self.server is not None
        try:
            self.server.serve()
        except BaseException as error:  # raised on the worker thread at its next call
            self._server_error = error
            if self._local is not None:
                self._local.failure = error  # wakes this process's worker if it waits

    # -- training -----------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups: set ``lr`` here (or with a scheduler); the
        servers apply each push with the ratio of group 0's rate to its initial one."""
        return self.optimizer.param_groups

    def _open(self) -> None:
        """Let this rank's shard serve (after any checkpoint was loaded)."""
        if self.server is not None:
            self.server.open.set()

    def step(self) -> None:
        """Push this worker's gradients to every shard, then pull the new parameters."""
        self._check_usable()
        if self._closed:  # its shards no longer answer: it would wait out the whole timeout
            raise RuntimeError(
                "ParameterServer.step() after close(): this worker told every shard it was "
                "done. Call close() once, after the last step (build a new ParameterServer "
                "to train on)"
            )
        self._open()
        if not self.is_worker:
            raise RuntimeError("step() on a dedicated server rank: only workers train")
        factor = float(self.optimizer.param_groups[0]["lr"]) / self._base_lr
        for server_rank, (link, engine) in enumerate(zip(self._links, self._engines, strict=True)):
            header = torch.tensor(
                [PUSH, self.step_count, self._versions[server_rank], factor], dtype=torch.float64
            )
            link.sends.append((link.channel.send(header), header))
            items = []
            for index in self.shards[server_rank]:
                name, p = self.parameters[index]
                items.append(GradientItem(name, gradient_of(name, p), p))
            engine.exchange_bucket(items, last=True, step=self.step_count)
        for server_rank, link in enumerate(self._links):
            link.finish_sends()
            self._pull(server_rank, link)
        self.step_count += 1

    def _pull(self, server_rank: int, link: ServerLink) -> None:
        answer = torch.empty(ANSWER, dtype=torch.float64)
        link.channel.recv(answer).wait()
        if int(answer[0]) != FINE:
            raise NonFiniteGradientError(
                f"non-finite gradient (NaN or Inf) pushed at step {self.step_count} by a worker "
                f"(server rank {server_rank} applied nothing); lower the learning rate, clip "
                "gradients, or check the loss and the input data for NaN/Inf"
            )
        self._versions[server_rank] = int(answer[1])
        shard = [self.parameters[i][1] for i in self.shards[server_rank]]
        flat = torch.empty(sum(p.numel() for p in shard), dtype=wire_dtype(shard))
        link.channel.recv(flat).wait()
        with torch.no_grad():
            offset = 0
            for p in shard:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    # -- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of this rank's part: its step, the version it holds of each shard,
        its exchange state (error feedback, warm starts) and, on a server rank, its shard's
        parameters, optimizer state and exchange state. Save the model's ``state_dict()``
        beside it.

        Collective: every rank calls it after the same number of steps. It is a barrier:
        each shard waits until every worker has asked, copies its state, and answers with
        its parameters, so every worker leaves with the weights that were saved (in
        asynchronous mode too). Servers that are ranks of their own (``colocated=False``)
        cannot take part, since they only serve: checkpoints need colocated servers.
        """
        self._check_usable()
        if not self.colocated:
            raise RuntimeError(
                "ParameterServer.state_dict() needs colocated servers (the default): a "
                "dedicated server rank (colocated=False) only serves and cannot save its "
                "shard. Build it with colocated=True to take checkpoints"
            )
        if self._closed:
            raise RuntimeError("ParameterServer.state_dict() after close(): take it before")
        self._open()
        for server_rank, link in enumerate(self._links):
            header = torch.tensor(
                [SNAPSHOT, self.step_count, self._versions[server_rank], 0], dtype=torch.float64
            )
            link.channel.send(header).wait()
        for server_rank, link in enumerate(self._links):
            self._pull(server_rank, link)
        self._check_usable()
        state: dict[str, Any] = {
            "rank": self._identity(),
            "step": self.step_count,
            "versions": list(self._versions),
            "engines": [engine.state_dict() for engine in self._engines],
        }
        if self.server is not None:  # its snapshot was taken before it answered us
            state["server"], self.server.snapshot = self.server.snapshot, None
        return state

    def _identity(self) -> dict[str, Any]:
        """Which part of which setup a rank's checkpoint is."""
        return {
            "rank": self.rank,
            "world": self.world,
            "servers": self.servers,
            "mode": self.mode,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned on this rank, right after building the
        server and before the first step (every rank; load the model's weights too)."""
        if not self.colocated:
            raise RuntimeError(
                "ParameterServer.load_state_dict() needs colocated servers (the default), as "
                "state_dict() does"
            )
        expected = {"rank", "step", "versions", "engines"}
        expected |= {"server"} if self.is_server else set()
        if not isinstance(state, dict) or not expected <= set(state):
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"not a ParameterServer checkpoint of this rank: expected keys "
                f"{sorted(expected)}, got {found}; load each rank's own state_dict()"
            )
        if state["rank"] != self._identity():
            raise ValueError(
                f"this checkpoint is {state['rank']}'s part, this is {self._identity()}: "
                "load each rank's own state_dict(), into a ParameterServer with the same "
                "world size, servers and mode"
            )
        if self.step_count or (self.server is not None and self.server.open.is_set()):
            raise RuntimeError(
                "ParameterServer.load_state_dict() after this rank stepped or served: load "
                "the checkpoint right after building the server, on every rank"
            )
        if self.server is not None:
            self.server.check_restorable(state["server"])
        for engine, saved in zip(self._engines, state["engines"], strict=True):
            engine.check_state(saved)  # another compressor's state: refused before any change
        self.step_count = int(state["step"])
        self._versions = [int(v) for v in state["versions"]]
        for engine, saved in zip(self._engines, state["engines"], strict=True):
            engine.load_state_dict(saved)
        if self.server is not None:  # it waits for open: no push is applied before this
            self.server.restore(state["server"])
        self._open()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def serve(self) -> None:
        """On a dedicated server rank: answer the workers until they all close."""
        if self.server is None or self._server_thread is not None:
            where = (
                "its servers run inside the workers (colocated=True) and serve on their own"
                if self.colocated
                else f"rank {self.rank} is a worker (the servers are ranks 0 .. {self.servers - 1})"
            )
            raise RuntimeError(
                f"serve() is for dedicated server ranks, and {where}: call it only where "
                "ps.is_server and not ps.is_worker, and step() on the workers"
            )
        self._open()
        if not self._served:
            self._served = True
            self.server.serve()

    def close(self) -> None:
        """Tell every shard this worker is done; on a server rank, wait until the shard
        has served every worker. Call on every rank."""
        if self._closed:
            return
        shutdown.unregister(self)
        self._say_closed()
        if self._server_thread is not None:
            self._server_thread.join(self.timeout.total_seconds())
            self._check_usable()
            if self._server_thread.is_alive():
                raise CommunicationError(
                    f"close() on rank {self.rank}: its server shard still waits for workers "
                    f"after {self.timeout.total_seconds():g} s (the timeout). A shard finishes "
                    "when every worker has closed: call close() on every rank after its last "
                    "step (in a finally: block, so that an error does not skip it)."
                )
        elif self.server is not None and not self.is_worker:
            self.serve()

    def close_for_shutdown(self, timeout: float) -> None:
        """:meth:`close` where the user did not call it, before the group is destroyed or
        the interpreter exits: every shard told this worker is done, a colocated shard
        given at most ``timeout`` s to finish serving (a dedicated server rank that never
        served is left alone)."""
        if self._closed:
            return
        self._say_closed()
        if self._server_thread is not None:
            self._server_thread.join(timeout)

    def _say_closed(self) -> None:
        self._closed = True
        self._open()
        if self.is_worker:
            for link in self._links:
                header = torch.tensor([CLOSE, self.step_count, 0, 0], dtype=torch.float64)
                link.channel.send(header).wait()

    def _check_usable(self) -> None:
        if self._server_error is not None:
            raise self._server_error

    @property
    def versions(self) -> list[int]:
        """The version of each shard this worker last pulled."""
        return list(self._versions)


def _copy_compressor(compressor: Compressor) -> Compressor:
    """A fresh instance with the same options (compressors keep per-key state)."""
    import copy

    return copy.deepcopy(compressor)
