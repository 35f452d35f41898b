"""Pipeline messages on links that several flows share at once, as TCP shares them: every
message being sent on a link gets an equal part of its bandwidth (a fluid model:
processor sharing), recomputed whenever one starts or ends.

The rest is as :class:`thinwire.plan.schedule_sim`'s first-in-first-out wire: a message
leaves once its send is posted and its receiver's "ready" note is in; each way between two
ranks is one byte stream, so a message, or a ready note, waits behind what its socket
already carries; the send completes ``buffered_s`` (at the link's full rate) before its
last byte is on the wire. What differs is between sockets: where the first-in-first-out
wire serves the pipelines crossing one link one message at a time (so they drift apart),
here they progress together, each at its share.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

_FWD = "fwd"
_Wired = tuple[int, str, int, int]  # (replica, direction, boundary, micro-batch)
_Event = tuple[float, object, str]
_EPSILON = 1e-12


def ends(key: _Wired, ranks: int = 0) -> tuple[int, int]:
    """The (sender, receiver) stages of message ``key``; with ``ranks``, the pipeline
    ranks that hold them (stage ``s`` on rank ``s % ranks``: interleaved 1F1B)."""
    _, way, boundary, _ = key
    pair = (boundary, boundary + 1) if way == _FWD else (boundary + 1, boundary)
    return (pair[0] % ranks, pair[1] % ranks) if ranks else pair


def way(name: Hashable, sender: int, receiver: int, along: bool) -> Hashable:
    """What a message on link ``name`` queues for (``along``: the way its boundary's
    forward messages go). A pair of hosts ``(a, b)``, as the planner names a link between
    two hosts, is the sending host's uplink, whatever ranks, boundaries and destinations
    use it: interleaved 1F1B crosses the same hosts at several boundaries, and a pipeline
    over more than two hosts sends forward to one host and backward to another through the
    same uplink (the emulated cluster's ``tbf``; the receiving host's downlink, limited
    too, is not modelled). Any other name is one way per pair of ranks."""
    if isinstance(name, tuple) and len(name) == 2:
        return ("uplink", name[0] if along else name[1])
    return (name, sender, receiver)


@dataclass
class _Link:
    """One way of a link: the messages on it, each with the seconds (at the full rate) it
    still needs, and a version that outdates the events scheduled before a change."""

    active: dict[_Wired, float] = field(default_factory=dict)
    sent: set[_Wired] = field(default_factory=set)
    updated: float = 0.0
    version: int = 0


class FluidWire:
    """The byte streams between stages, links shared among the messages on them."""

    def __init__(
        self, forward: Sequence[object], backward: Sequence[object],
        links: Sequence[Sequence[Hashable]], ranks: int = 0,
    ) -> None:  # fmt: skip
        self.messages = {_FWD: forward, "bwd": backward}
        self.links = links
        self.ranks = ranks  # stages fold onto this many ranks (0: a rank per stage)
        self.ways: dict[Hashable, _Link] = {}
        self.socket_busy: dict[tuple[int, int, int], bool] = {}
        self.socket_queue: dict[tuple[int, int, int], list[tuple[str, _Wired]]] = {}
        self.send_posted: set[_Wired] = set()
        self.ready: set[_Wired] = set()
        self.sent: dict[_Wired, float] = {}
        self.arrived: dict[_Wired, float] = {}

    def _message(self, key: _Wired) -> object:
        return self.messages[key[1]][key[2]]

    def _way(self, key: _Wired, sender: int, receiver: int) -> Hashable:
        return way(self.links[key[2]][key[0]], sender, receiver, key[1] == _FWD)

    def post_recv(self, key: _Wired, now: float) -> list[_Event]:
        """The receiver posts ``key``'s receive: its ready note joins its socket's queue."""
        sender, receiver = ends(key, self.ranks)
        return self._enqueue((key[0], receiver, sender), ("note", key), now)

    def post_send(self, key: _Wired, now: float) -> list[_Event]:
        """The sender posts ``key``'s send; it starts once the ready note is in."""
        self.send_posted.add(key)
        return self._data(key, now) if key in self.ready else []

    def note_arrived(self, key: _Wired, now: float) -> list[_Event]:
        """``key``'s ready note reached the sender; the data starts if it is posted."""
        self.ready.add(key)
        return self._data(key, now) if key in self.send_posted else []

    def _data(self, key: _Wired, now: float) -> list[_Event]:
        sender, receiver = ends(key, self.ranks)
        return self._enqueue((key[0], sender, receiver), ("data", key), now)

    def _enqueue(self, socket: tuple[int, int, int], item: tuple[str, _Wired], now: float):
        self.socket_queue.setdefault(socket, []).append(item)
        return [] if self.socket_busy.get(socket) else self._next_on(socket, now)

    def _next_on(self, socket: tuple[int, int, int], now: float) -> list[_Event]:
        """Start what waits on ``socket``: notes go at once, then the next message."""
        events: list[_Event] = []
        queue = self.socket_queue.get(socket, [])
        while queue:
            kind, key = queue.pop(0)
            if kind == "note":
                events.append((now + self._message(key).latency_s, key, "ready"))  # type: ignore[attr-defined]
                continue
            self.socket_busy[socket] = True
            sender, receiver = ends(key, self.ranks)
            name = self._way(key, sender, receiver)
            way = self.ways.setdefault(name, _Link())
            self._advance(way, now)
            way.active[key] = self._message(key).serialise_s  # type: ignore[attr-defined]
            return events + self._settle(name, now)
        self.socket_busy[socket] = False
        return events

    @staticmethod
    def _advance(way: _Link, now: float) -> None:
        if way.active:
            share = (now - way.updated) / len(way.active)
            for key in way.active:
                way.active[key] -= share
        way.updated = now

    def _settle(self, name: Hashable, now: float) -> list[_Event]:
        """Note what has been sent or has arrived on link way ``name`` by ``now``, start
        what waited behind it, and schedule the next change."""
        way = self.ways[name]
        events: list[_Event] = []
        freed = []
        for key, left in list(way.active.items()):
            message = self._message(key)
            if key not in way.sent and left <= message.buffered_s + _EPSILON:  # type: ignore[attr-defined]
                way.sent.add(key)
                events.append((now, key, "sent"))
            if left <= _EPSILON:
                del way.active[key]
                events.append((now + message.latency_s, key, "arrived"))  # type: ignore[attr-defined]
                sender, receiver = ends(key, self.ranks)
                freed.append((key[0], sender, receiver))
        for socket in freed:  # what waited behind a finished message starts now
            events += self._next_on(socket, now)
        way.version += 1
        if way.active:
            count = len(way.active)
            wait = min(
                (left - (0.0 if key in way.sent else self._message(key).buffered_s)) * count  # type: ignore[attr-defined]
                for key, left in way.active.items()
            )
            events.append((now + max(0.0, wait), (name, way.version), "link"))
        return events

    def link_changed(self, payload: tuple[tuple, int], now: float) -> list[_Event]:
        """A scheduled change on a link way: a message there sent or done (if still due)."""
        name, version = payload
        way = self.ways[name]
        if version != way.version:
            return []
        self._advance(way, now)
        return self._settle(name, now)
