"""The event loop: a heap of timed events and the simulated clock they advance.

An event is a callable with its arguments, due at a simulated time. Events run in time order;
events due at the same time run in the order they were scheduled (a counter breaks ties), so a
simulation is a pure function of its inputs and seed. Nothing here reads the wall clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._order = itertools.count()
        self.num_events = 0  # events run so far

    def at(self, when: float, action: Callable, *args) -> None:
        """Run `action(*args)` at simulated time `when` (never in the past)."""
        heapq.heappush(self._heap, (max(when, self.now), next(self._order), action, args))

    def after(self, delay: float, action: Callable, *args) -> None:
        self.at(self.now + delay, action, *args)

    def clock(self) -> float:
        """The simulated time; handed to policies that read a clock (FastServe)."""
        return self.now

    @property
    def pending(self) -> int:
        return len(self._heap)

    def run(self, until: float = math.inf, stop: Callable[[], bool] | None = None) -> None:
        """Run events in order until none is left, the next is due after `until`, or `stop()`
        says so (checked after each event)."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            when, _, action, args = heapq.heappop(heap)
            self.now = when
            self.num_events += 1
            action(*args)
            if stop is not None and stop():
                return
