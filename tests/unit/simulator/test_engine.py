"""The event loop: time order, ties in scheduling order, never back in time, stops."""

from __future__ import annotations

from simulator.engine import EventLoop


def test_events_run_in_time_order_and_ties_in_the_order_scheduled():
    loop, seen = EventLoop(), []
    for when, name in [(3.0, "c"), (1.0, "a"), (2.0, "b1"), (2.0, "b2"), (0.5, "first")]:
        loop.at(when, lambda n=name: seen.append((loop.now, n)))
    loop.run()
    assert seen == [(0.5, "first"), (1.0, "a"), (2.0, "b1"), (2.0, "b2"), (3.0, "c")]
    assert loop.num_events == 5 and loop.pending == 0


def test_an_event_scheduled_from_an_event_runs_after_the_ones_already_due_then():
    loop, seen = EventLoop(), []

    def first():
        seen.append("first")
        loop.after(0.0, seen.append, "scheduled at the same time")
        loop.at(-5.0, seen.append, "never in the past")

    loop.at(1.0, first)
    loop.at(1.0, seen.append, "due before")
    loop.run()
    assert seen == ["first", "due before", "scheduled at the same time", "never in the past"]
    assert loop.now == 1.0


def test_run_stops_at_until_and_when_asked():
    loop, seen = EventLoop(), []
    for t in range(10):
        loop.at(float(t), seen.append, t)
    loop.run(until=4.5)
    assert seen == [0, 1, 2, 3, 4] and loop.pending == 5
    loop.run(stop=lambda: len(seen) >= 7)
    assert seen == [0, 1, 2, 3, 4, 5, 6] and loop.clock() == 6.0
