"""A pipeline schedule's step, simulated action by action (pure Python, no torch).

Every pipeline rank runs the program PyTorch's schedule runs for its stage
(``torch.distributed.pipelining``'s :class:`ScheduleGPipe` and :class:`Schedule1F1B`, one
model chunk per rank): computes, posts sends and receives, and waits, in that order, with
the same waits. Where the real 1F1B waits for a forward send together with the next
gradient's receive, so does the simulation: the bubble comes out of the schedule's own
dependencies, not out of the textbook ``(p - 1) / (m + p - 1)``.

A message between stages ``b`` and ``b + 1`` (a micro-batch's activation forward, its
gradient backward) goes as gloo's TCP transport sends it: the receiver's posted receive
sends a small "ready" note to the sender; the data leaves once the send is posted and the
note is in. Each way between two ranks is one byte stream, first in first out, carrying
that side's data and its ready notes for the other way, so a note waits behind the data
queued before it. That is why torch's pipelining over gloo runs both ways of a link in
turn rather than at once: on the emulated cluster (2 hosts, 10 Mbit/s, 1 MiB per
micro-batch, 4 micro-batches, 10 ms compute) GPipe and 1F1B took 7.2-7.3 s a step,
where overlapped ways would take about 5 s; this simulation gives 7.1 s. A send completes
``buffered_s`` before its last byte is on the wire (the socket buffer holds the tail).

    times = simulate("1f1b", microbatches=4,
                     stages=[StageTimes(0.1, 0.2), StageTimes(0.1, 0.2)],
                     forward=[Message(0.87, 0.001, 0.5)], backward=[Message(0.87, 0.001, 0.5)])
    times.step_s, times.stage_end_s, times.bubble_s, times.peak_in_flight
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from thinwire.parallel.interleaved_program import INTERLEAVED, interleaved_programs
from thinwire.parallel.schedule_programs import BWD, FWD, PROGRAM_SCHEDULES, program
from thinwire.plan.fluid_wire import FluidWire, ends, way

#: the schedules simulated here, by the names a :class:`thinwire.ParallelPlan` gives them
SIMULATED_SCHEDULES = (*PROGRAM_SCHEDULES, INTERLEAVED)


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one micro-batch's forward and backward pass on one stage (its
    tensor-parallel collectives included; the last stage's loss in its forward)."""

    forward_s: float
    backward_s: float
    recompute_s: float = 0.0
    """One micro-batch's recomputation (its checkpointed blocks' forward again); where
    it runs is the schedule's (:mod:`thinwire.parallel.schedule_programs`)."""

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "recompute_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"a stage's {name} must be >= 0 seconds, got {value!r}")


@dataclass(frozen=True)
class Message:
    """One micro-batch's message across one stage boundary: ``serialise_s`` on the link
    (its bytes over the bandwidth it gets), then ``latency_s`` to arrive."""

    serialise_s: float
    latency_s: float = 0.0
    buffered_s: float = 0.0
    """The tail of the message the sender's socket buffer takes: the send completes this
    long before the last byte is on the wire (the buffer's bytes over the bandwidth)."""

    def __post_init__(self) -> None:
        if not (self.serialise_s >= 0 and self.latency_s >= 0 and self.buffered_s >= 0):
            raise ValueError(f"a message's times must be >= 0, got {self}")


@dataclass(frozen=True)
class PipelineTimes:
    """The simulated step: when each pipeline rank finishes its last action, and its
    compute (a rank per stage, but for interleaved 1F1B: two stages a rank)."""

    stage_end_s: tuple[float, ...]
    stage_busy_s: tuple[float, ...]
    peak_in_flight: tuple[int, ...] = ()
    """Per stage, the most micro-batches whose forward ran and backward did not yet: the
    activations it holds at once (GPipe: all of them; 1F1B: ``min(m, stages - stage)``)."""
    timeline: tuple[tuple[int, str, int, float, float], ...] = ()
    """The first replica's computes: ``(stage, "F" | "R" | "B", micro-batch, start, end)``."""

    @property
    def step_s(self) -> float:
        """The pipeline's makespan: the last stage to finish."""
        return max(self.stage_end_s)

    @property
    def bubble_s(self) -> float:
        """Time the busiest stage spends waiting (for data, or for the link)."""
        busiest = max(range(len(self.stage_busy_s)), key=self.stage_busy_s.__getitem__)
        return self.stage_end_s[busiest] - self.stage_busy_s[busiest]


_Wired = tuple[int, str, int, int]  # (replica, direction, boundary, micro-batch)


class _Wire:
    """The byte streams between neighbouring stages, first in first out.

    gloo sends a message only once its receiver has posted the receive: the receiver
    sends a small "ready" note on its own socket to the sender, behind the data that socket
    already carries the other way; the data leaves once the send is posted and the note
    is in. A boundary whose link the replicas share (the pairs of ranks crossing between
    two hosts at once) serves their data one message at a time, in the order it came, and
    a ready note crossing it waits behind the data already queued on it that way (one
    queue per way, as on the emulated cluster's links)."""

    def __init__(
        self,
        forward: Sequence[Message],
        backward: Sequence[Message],
        links: Sequence[Sequence[Hashable]],
        ranks: int = 0,
    ) -> None:
        self.messages = {FWD: forward, BWD: backward}
        self.links = links
        self.ranks = ranks  # stages fold onto this many ranks (0: a rank per stage)
        self.socket_free: dict[tuple[int, int, int], float] = {}
        self.link_free: dict[Hashable, float] = {}
        self.send_posted: dict[_Wired, float] = {}
        self.ready: set[_Wired] = set()
        self.sent: dict[_Wired, float] = {}
        self.arrived: dict[_Wired, float] = {}

    def _message(self, key: _Wired) -> Message:
        return self.messages[key[1]][key[2]]

    def post_recv(self, key: _Wired, now: float) -> list[tuple[float, _Wired, str]]:
        """The receiver posts ``key``'s receive: its ready note leaves for the sender."""
        sender, receiver = ends(key, self.ranks)
        link = way(self.links[key[2]][key[0]], receiver, sender, key[1] != FWD)  # the note's
        left = max(
            now,
            self.socket_free.get((key[0], receiver, sender), 0.0),
            self.link_free.get(link, 0.0),
        )
        return [(left + self._message(key).latency_s, key, "ready")]

    def post_send(self, key: _Wired, now: float) -> list[tuple[float, _Wired, str]]:
        """The sender posts ``key``'s send; it goes out now if the ready note is in."""
        self.send_posted[key] = now
        return self._transmit(key, now) if key in self.ready else []

    def note_arrived(self, key: _Wired, now: float) -> list[tuple[float, _Wired, str]]:
        """``key``'s ready note reached the sender; the data goes out if it is posted."""
        self.ready.add(key)
        return self._transmit(key, now) if key in self.send_posted else []

    def _transmit(self, key: _Wired, now: float) -> list[tuple[float, _Wired, str]]:
        message = self._message(key)
        sender, receiver = ends(key, self.ranks)
        socket = (key[0], sender, receiver)
        link = way(self.links[key[2]][key[0]], sender, receiver, key[1] == FWD)
        start = max(now, self.socket_free.get(socket, 0.0), self.link_free.get(link, 0.0))
        left = start + message.serialise_s
        self.socket_free[socket] = self.link_free[link] = left
        sent = max(now, left - message.buffered_s)
        return [(sent, key, "sent"), (left + message.latency_s, key, "arrived")]


def simulate(
    schedule: str,
    microbatches: int,
    stages: Sequence[StageTimes],
    forward: Sequence[Message] = (),
    backward: Sequence[Message] = (),
    replicas: int = 1,
    links: Sequence[Sequence[Hashable]] | None = None,
    sharing: str = "fifo",
    together: Sequence[Sequence[int]] = (),
) -> PipelineTimes:
    """One step of ``schedule`` over ``len(stages)`` pipeline ranks and ``microbatches``
    micro-batches; ``forward[b]`` and ``backward[b]`` are the messages across boundary
    ``b`` (between stages ``b`` and ``b + 1``). ``replicas`` pipelines run side by side
    (the data- and tensor-parallel ranks of a plan); ``links[b][r]`` names the link replica
    ``r`` crosses boundary ``b`` on: replicas on the same link share it (``serialise_s`` is
    a message's time with the link to itself). By default each has its own. ``sharing``:
    ``"fifo"`` (one message at a time, in arrival order: the default) or ``"fluid"`` (the
    messages on a link progress together, each at its share:
    :mod:`thinwire.plan.fluid_wire`); the planner weighs the two by how the probe found
    the link serving messages sent together (:mod:`thinwire.plan.shared_links`).
    ``together``: sets of replicas whose ranks start each compute together, the
    tensor-parallel ranks of one pipeline stage (a pass's first all-reduce waits for the
    last of them, so none runs ahead on a message that reached it first); by default
    every replica runs on its own."""
    if schedule not in SIMULATED_SCHEDULES:
        raise ValueError(
            f"the planner simulates the schedules {', '.join(SIMULATED_SCHEDULES)}, not "
            f"{schedule!r}: plan with one of those"
        )
    for name, value in (("micro-batches", microbatches), ("replicas", replicas)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    count = len(stages)
    if count < 1:
        raise ValueError("a pipeline needs at least one stage")
    if len(forward) != count - 1 or len(backward) != count - 1:
        raise ValueError(
            f"{count} stages have {count - 1} boundaries: got {len(forward)} forward and "
            f"{len(backward)} backward messages"
        )
    if links is None:
        links = [list(range(replicas))] * (count - 1)
    if len(links) != count - 1 or any(len(per) != replicas for per in links):
        raise ValueError(
            f"links needs, per boundary ({count - 1}), a link per replica ({replicas})"
        )
    if sharing not in ("fluid", "fifo"):
        raise ValueError(f"sharing is 'fluid' or 'fifo', not {sharing!r}")
    coupled = [r for group in together for r in group]
    if len(set(coupled)) != len(coupled) or not set(coupled) <= set(range(replicas)):
        raise ValueError(
            f"together names sets of distinct replicas among 0..{replicas - 1}, got {together!r}"
        )
    ranks = 0
    if schedule == INTERLEAVED:
        if count % 2 or count < 4:
            raise ValueError(
                f"interleaved 1F1B runs two stages on each of pp >= 2 ranks: got {count} stages"
            )
        ranks = count // 2
    wire = (
        FluidWire(forward, backward, links, ranks)
        if sharing == "fluid"
        else _Wire(forward, backward, links, ranks)
    )
    return _EventLoop(schedule, microbatches, stages, wire, replicas, ranks, together).run()


class _EventLoop:
    """Runs every stage's program (of every replica) against the wire, in time order."""

    def __init__(
        self,
        schedule: str,
        microbatches: int,
        stages: Sequence[StageTimes],
        wire: _Wire | FluidWire,
        replicas: int,
        ranks: int = 0,
        together: Sequence[Sequence[int]] = (),
    ) -> None:
        self.schedule = schedule
        self.stages = stages
        self.wire = wire
        count = len(stages)
        self.ranks = ranks  # 0: a rank per stage; else stages fold onto this many ranks
        per_replica = ranks or count
        self.actors = [(r, k) for r in range(replicas) for k in range(per_replica)]
        if ranks:
            recompute = tuple(stage.recompute_s > 0 for stage in stages)
            folded = interleaved_programs(ranks, microbatches, recompute)
            self.programs = {actor: iter(folded[actor[1]]) for actor in self.actors}
        else:  # one program per stage, whatever the replicas running it
            by_stage = [
                program(schedule, s, count, microbatches, stages[s].recompute_s > 0)
                for s in range(count)
            ]
            self.programs = {actor: iter(by_stage[actor[1]]) for actor in self.actors}
        self.clock = dict.fromkeys(self.actors, 0.0)
        self.busy = dict.fromkeys(self.actors, 0.0)
        held = [(r, s) for r in range(replicas) for s in range(count)]
        self.in_flight = dict.fromkeys(held, 0)
        self.peak = dict.fromkeys(held, 0)
        self.timeline: list[tuple[int, str, int, float, float]] = []
        self.waiting: dict[tuple[int, int], list[_Wired]] = {}
        self.finished: set[tuple[int, int]] = set()
        self.events: list[tuple[float, int, str, object]] = []
        self.counter = itertools.count()
        #: per replica, the replicas it starts each compute with (itself alone by default)
        self.partners = {r: (r,) for r in range(replicas)}
        for group in together:
            self.partners.update(dict.fromkeys(group, tuple(group)))
        self.computes = dict.fromkeys(self.actors, 0)  # computes each actor has reached
        #: computes some partners reached, waiting for the rest: who, and what each runs
        self.gates: dict[tuple, list[tuple[tuple[int, int], tuple]]] = {}

    def _push(self, when: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (when, next(self.counter), kind, payload))

    def run(self) -> PipelineTimes:
        for actor in self.actors:
            self._push(0.0, "run", actor)
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "run":
                self._advance(payload, now)  # type: ignore[arg-type]
                continue
            if kind == "link":
                for when, k, what in self.wire.link_changed(payload, now):  # type: ignore[union-attr]
                    self._push(when, what, k)
                continue
            key: _Wired = payload  # type: ignore[assignment]
            if kind == "ready":
                for when, k, what in self.wire.note_arrived(key, now):
                    self._push(when, what, k)
                continue
            (self.wire.sent if kind == "sent" else self.wire.arrived)[key] = now
            for rank in ends(key, self.ranks):
                actor = (key[0], rank)
                if actor in self.waiting and self._settled(actor) is not None:
                    del self.waiting[actor]
                    self._push(now, "run", actor)
        if len(self.finished) != len(self.actors):
            raise RuntimeError(f"the simulated {self.schedule} schedule deadlocked: {self.waiting}")
        count = len(self.stages)
        ranks = self.ranks or count
        replicas = range(len(self.actors) // ranks)
        return PipelineTimes(
            tuple(max(self.clock[(r, k)] for r in replicas) for k in range(ranks)),
            tuple(self.busy[(0, k)] for k in range(ranks)),
            tuple(self.peak[(0, s)] for s in range(count)),
            tuple(sorted(self.timeline, key=lambda event: (event[0], event[3]))),
        )

    def _settled(self, actor: tuple[int, int]) -> float | None:
        """When everything ``actor`` waits for completed on its side (sent, or arrived),
        if it has: the hottest loop of a search, so the sender of each key (``ends``) is
        worked out inline."""
        rank, ranks = actor[1], self.ranks
        sent, arrived = self.wire.sent, self.wire.arrived
        latest = 0.0
        for key in self.waiting[actor]:
            sender = key[2] if key[1] == FWD else key[2] + 1
            if ranks:
                sender %= ranks
            end = (sent if sender == rank else arrived).get(key)
            if end is None:
                return None
            latest = max(latest, end)
        return latest

    def _compute(self, actor: tuple[int, int], op: tuple) -> None:
        """Start ``actor``'s compute ``op`` at its clock; it runs on when that is done."""
        replica, rank = actor
        stage = op[4] if len(op) > 4 else rank  # interleaved: the stage it names
        times = self.stages[stage]
        seconds = {"F": times.forward_s, "R": times.recompute_s, "B": times.backward_s}[op[1]]
        self.busy[actor] += seconds
        if replica == 0:
            start = self.clock[actor]
            self.timeline.append((stage, op[1], op[2], start, start + seconds))
        held = (replica, stage)
        self.in_flight[held] += {"F": 1, "R": 0, "B": -1}[op[1]]
        self.peak[held] = max(self.peak[held], self.in_flight[held])
        self._push(self.clock[actor] + seconds, "run", actor)

    def _advance(self, actor: tuple[int, int], now: float) -> None:
        self.clock[actor] = max(self.clock[actor], now)
        replica, rank = actor
        for op in self.programs[actor]:
            if op[0] == "compute":
                partners = self.partners[replica]
                if len(partners) == 1:  # no partner to wait for (most plans: no gate)
                    self._compute(actor, op)
                    return
                gate = (partners, rank, self.computes[actor])
                self.computes[actor] += 1
                reached = self.gates.setdefault(gate, [])
                reached.append((actor, op))
                if len(reached) < len(partners):
                    return  # the partners' "run" resumes it
                del self.gates[gate]
                start = max(self.clock[a] for a, _ in reached)
                for who, what in reached:
                    self.clock[who] = start
                    self._compute(who, what)
                return
            if op[0] == "post":
                key = (replica, *op[1])
                post = self.wire.post_recv if op[2] == "recv" else self.wire.post_send
                for when, k, what in post(key, self.clock[actor]):
                    self._push(when, what, k)
                continue
            self.waiting[actor] = [(replica, *k) for k in op[1]]
            if self._settled(actor) is None:
                return
            del self.waiting[actor]
        self.finished.add(actor)
