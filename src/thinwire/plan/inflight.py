"""All-reduces in flight on one process group, for the cost model of sub-batches
(:func:`thinwire.plan.turns.in_turns_s`).

Each all-reduce has two parts, from the probe (:meth:`thinwire.plan.probe.Fit.overlap_at`):
the *rest* (its bytes on the wire and the share of its latency no other all-reduce hides)
and the *hidden* latency. The all-reduces in their rest share the group's link equally (a
fluid: with two, each advances at half speed; TCP flows sharing a link do about that), then
each waits out its hidden latency on its own. So one alone takes ``rest + hidden`` and two
issued together both end at ``2 rest + hidden``: what the probe timed when it measured the
share hidden. A group runs at most ``at_once`` collectives (gloo: one per worker thread);
the others wait, in the order they were issued, for one of those to end.
"""

from __future__ import annotations

import math
from collections import deque

#: remaining work below this (seconds) is done (float rounding of the shares)
_EPSILON = 1e-12


class InFlight:
    """The all-reduces of one group over time: :meth:`issue` them in time order, ask when
    one ends with :meth:`end`."""

    def __init__(self, at_once: int | None = None) -> None:
        if at_once is not None and at_once < 1:
            raise ValueError(f"at least one collective must run at a time, got at_once={at_once}")
        self.at_once = at_once
        self.now = 0.0
        self._sharing: dict[int, float] = {}  # id -> rest left, in seconds alone on the link
        self._hiding: dict[int, float] = {}  # id -> when its hidden latency ends
        self._waiting: deque[tuple[int, float, float]] = deque()
        self._hidden: dict[int, float] = {}
        self._ended: dict[int, float] = {}
        self._issued = 0

    def issue(self, at: float, rest: float, hidden: float) -> int:
        """An all-reduce issued at ``at`` (not before the last one issued); its id."""
        if at < self.now - _EPSILON:
            raise ValueError(f"all-reduces are issued in time order: {at} is before {self.now}")
        self._advance(at)
        ident, self._issued = self._issued, self._issued + 1
        self._waiting.append((ident, max(0.0, rest), max(0.0, hidden)))
        self._start_waiting()
        return ident

    def end(self, ident: int) -> float:
        """When all-reduce ``ident`` ends, given the ones issued so far (call it only when
        no other is issued before that end: a sub-batch waiting for its own)."""
        while ident not in self._ended:
            if not self._advance(math.inf, stop=ident):
                raise ValueError(f"all-reduce {ident} was never issued")
        return self._ended[ident]

    def _running(self) -> int:
        return len(self._sharing) + len(self._hiding)

    def _start_waiting(self) -> None:
        while self._waiting and (self.at_once is None or self._running() < self.at_once):
            ident, rest, hidden = self._waiting.popleft()
            self._hidden[ident] = hidden
            if rest > _EPSILON:
                self._sharing[ident] = rest
            else:
                self._hiding[ident] = self.now + hidden

    def _advance(self, until: float, stop: int | None = None) -> bool:
        """Run the group to ``until`` (or until ``stop`` ends); False if nothing was left
        to run."""
        until = max(until, self.now)
        while True:
            sharing = len(self._sharing)
            next_share = self.now + min(self._sharing.values()) * sharing if sharing else math.inf
            next_hide = min(self._hiding.values()) if self._hiding else math.inf
            event = min(next_share, next_hide)
            if event == math.inf and until == math.inf:
                return False
            step_to = min(event, until)
            if sharing:
                done = (step_to - self.now) / sharing
                for ident in self._sharing:
                    self._sharing[ident] -= done
            self.now = max(self.now, step_to)
            if event > until:
                return True
            for ident in [i for i, left in self._sharing.items() if left <= _EPSILON]:
                del self._sharing[ident]
                self._hiding[ident] = self.now + self._hidden[ident]
            for ident in [i for i, ends in self._hiding.items() if ends <= self.now + _EPSILON]:
                self._ended[ident] = self._hiding.pop(ident)
            self._start_waiting()
            if stop is not None and stop in self._ended:
                return True
