"""The control link's report writer: repeats the last load report while the loop is inside a
long forward, stops once the loop has been silent past the stall timeout, keeps events in order."""

from __future__ import annotations

import time

from common.engine.control_link import ReportWriter
from common.protocol import FlipReport, InstanceStats


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_repeats_the_last_report_until_the_stall_timeout_then_goes_silent():
    sent, events = [], []
    writer = ReportWriter(sent.append, events.append, interval_s=0.02, stall_s=0.5, name="t")
    try:
        stats = InstanceStats("i0", "prefill", "tcp://i0", "kv://i0", "m", 256, 32, 32)
        writer.report(stats)  # the loop's last report before a long forward
        assert wait_until(lambda: len(sent) >= 3)  # repeated without a new report
        assert all(s is stats for s in sent)
        time.sleep(0.6)  # past the stall timeout: the loop is taken for stuck
        silent_at = len(sent)
        time.sleep(0.2)
        assert len(sent) == silent_at
        writer.report(stats)  # the loop came back
        assert wait_until(lambda: len(sent) > silent_at)
    finally:
        writer.close()


def test_events_are_delivered_once_and_in_order():
    sent, events = [], []
    writer = ReportWriter(sent.append, events.append, interval_s=0.02, stall_s=1.0, name="t")
    try:
        flips = [FlipReport(str(i), "i0", "prefill", "decode", 0.0, 0.0, 0.0) for i in range(5)]
        for flip in flips:
            writer.notify(flip)
        assert wait_until(lambda: len(events) == 5)
        time.sleep(0.1)
        assert [e.flip_id for e in events] == ["0", "1", "2", "3", "4"]
        assert not sent  # no load report was given
    finally:
        writer.close()
