"""Instances that share a machine's cores: their forwards slow down while more threads want a
core than there are cores (`Layout.shared_cores`).

Why: on the 2-core development machine a 1P2D cluster runs three 1-thread instances. Their
forward logs (docs/simulator.md, the twelfth session's runs) show a forward at its profiled
speed while it runs alone or beside one other, and 1.5 times slower while all three run (three
threads on two cores: each gets two thirds of one). One k per kind averages that over a load,
and how often all three run differs from load to load. Each instance's forward is a job of its
priced seconds of work; while n threads run on c cores each job advances at min(1, c / n)
seconds of work per second (the kernel's fair share). A GPU cluster, where every instance has
its own accelerator, leaves `shared_cores` unset and this class unused.

`work_seconds` is the same model read backwards for the calibration (simulator.calibrate): a
logged forward's seconds of work are its wall time weighted by the share it had, which the
overlapping forwards of the other instances' logs give.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

from simulator.engine import EventLoop


class SharedCores:
    """The forwards in flight on `cores` cores, `threads` threads each."""

    def __init__(self, loop: EventLoop, cores: int, threads: int = 1) -> None:
        if cores < 1 or threads < 1:
            raise ValueError("shared cores and threads per instance must be >= 1")
        self.loop, self.cores, self.threads = loop, cores, threads
        # owner -> [work left (s), started, ticket, done callback]
        self.jobs: dict[object, list] = {}
        self.updated = 0.0  # when the work left was last brought up to date
        self._tickets = itertools.count(1)

    def share(self) -> float:
        """Seconds of work each forward in flight does per second."""
        wanted = len(self.jobs) * self.threads
        return min(1.0, self.cores / wanted) if wanted else 1.0

    def start(self, owner: object, work_s: float, done: Callable[[float], None]) -> None:
        """`owner` starts a forward of `work_s` seconds alone; `done(wall seconds)` runs when it
        ends. An owner has one forward in flight at a time."""
        if owner in self.jobs:
            raise RuntimeError("an instance started a forward while its last one ran")
        self._advance()
        self.jobs[owner] = [work_s, self.loop.now, 0, done]
        self._reschedule()

    def _advance(self) -> None:
        elapsed = self.loop.now - self.updated
        if elapsed > 0.0 and self.jobs:
            worked = elapsed * self.share()
            for job in self.jobs.values():
                job[0] -= worked
        self.updated = self.loop.now

    def _reschedule(self) -> None:
        """Every forward's end moves when the share changes; earlier events go stale."""
        share = self.share()
        for owner, job in self.jobs.items():
            job[2] = next(self._tickets)
            self.loop.at(self.loop.now + max(job[0], 0.0) / share, self._end, owner, job[2])

    def _end(self, owner: object, ticket: int) -> None:
        job = self.jobs.get(owner)
        if job is None or job[2] != ticket:
            return
        self._advance()
        del self.jobs[owner]
        self._reschedule()
        job[3](self.loop.now - job[1])


def work_seconds(lines: list[dict], cores: int, threads: int = 1) -> list[dict]:
    """Forward-log lines (every instance's, one window) with `forward_s` replaced by the seconds
    of work each forward did: its wall time, each stretch weighted by min(1, cores / threads in
    a forward then). Lines outside the list count for nothing (a forward of another instance
    that began before the window is missed: a few at the window's edges)."""
    edges = sorted([(line["time"] - line["forward_s"], threads) for line in lines]
                   + [(line["time"], -threads) for line in lines])
    times, running, wanted = [], [], 0
    for when, change in edges:
        wanted += change
        times.append(when)
        running.append(wanted)  # threads wanting a core from times[i] to times[i + 1]
    out = []
    for line in lines:
        begin, end = line["time"] - line["forward_s"], line["time"]
        # both are edges themselves, so from the last edge at `begin` every step up to `end`
        # has an edge after it
        i, at, work = bisect.bisect_right(times, begin) - 1, begin, 0.0
        while at < end:
            upto = min(times[i + 1], end)
            work += (upto - at) * min(1.0, cores / max(running[i], threads))
            at, i = upto, i + 1
        out.append({**line, "forward_s": work})
    return out
