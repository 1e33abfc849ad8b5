"""The instance loop's order within a turn (common/engine/worker.py): the load report goes out
after the turn's messages are handled and before the forward, so a request received during the
previous forward is counted by the report that stands while it is prefilled."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.engine import worker as worker_module
from common.engine.worker import InstanceWorker
from common.protocol import GenerateRequest
from common.sampling_params import SamplingParams


def make_worker(events: list[str], messages: list, plan_empty: bool = False) -> InstanceWorker:
    """An InstanceWorker without a model: only what `_turn` touches, each recording its call."""
    worker = object.__new__(InstanceWorker)
    worker.inbox = SimpleNamespace(receive=lambda wait: [events.append("receive"), *messages][1:])
    worker.link = SimpleNamespace(receive=lambda: [])
    worker.role = SimpleNamespace(
        has_work=True, wait_s=0.01, handle=lambda m: events.append(f"handle {m}"),
        admit_compiled=lambda: None, poll=lambda: events.append("poll"),
        schedule=lambda: (events.append("schedule"),
                          SimpleNamespace(is_empty=plan_empty, chunks=[], num_padding_tokens=0,
                                          swap_out=[], swap_in=[]))[1],
        update_from_output=lambda plan, output: events.append("update"))
    worker.runner = SimpleNamespace(execute=lambda plan: (
        events.append("forward"), SimpleNamespace(forward_seconds=5.0))[1])
    worker.metrics = SimpleNamespace(count=lambda *a: None, last_turn=0.0)
    worker.busy_seconds, worker.computed_tokens = 0.0, 0
    worker.num_forwards, worker.forward_turn_seconds = 0, 0.0
    worker.forward_log = None
    worker._pending_flip = None
    worker._next_report = 0.0  # a report is due
    worker._flush_tokens = lambda: events.append("flush")
    worker._report = lambda: events.append("report")
    return worker


def test_report_is_sent_after_the_messages_and_before_the_forward():
    events: list[str] = []
    make_worker(events, ["generate"])._turn()
    assert events == ["receive", "handle generate", "poll", "report", "schedule", "forward",
                      "update", "flush"]


def test_a_turn_that_ran_a_forward_is_counted_and_timed_and_an_empty_one_is_not():
    worker = make_worker([], [])
    worker._turn()
    assert worker.num_forwards == 1 and worker.busy_seconds == 5.0  # the fake forward's time
    assert worker.forward_turn_seconds > 0  # the turn's own wall time (the fake is instant)
    idle = make_worker([], [], plan_empty=True)
    idle._turn()
    assert idle.num_forwards == 0 and idle.forward_turn_seconds == 0.0


def test_no_report_before_the_interval():
    events: list[str] = []
    worker = make_worker(events, [])
    worker._next_report = worker_module.time.monotonic() + 60.0
    worker._turn()
    assert "report" not in events and events[-1] == "flush"


def test_requests_received_are_counted_per_gateway_before_the_report():
    """InstanceStats.requests_seen, the echo the gateway's sent counts are acknowledged by."""
    events: list[str] = []
    requests = [GenerateRequest(f"r{i}", [1, 2, 3], SamplingParams(), gateway, 0.0, 60.0, 0)
                for i, gateway in enumerate(["tcp://g1:1", "tcp://g2:1", "tcp://g1:1"])]
    worker = make_worker(events, requests)
    worker.requests_seen = {}
    seen_at_report = []
    worker._report = lambda: seen_at_report.append(dict(worker.requests_seen))
    worker._turn()
    assert seen_at_report == [{"tcp://g1:1": 2, "tcp://g2:1": 1}]


def test_the_inbox_read_counts_as_the_turns_work_unless_the_loop_waited_there_for_work():
    """forward_turn_seconds: reading the inbox between forwards is the loop's own work (the
    simulator's turn overhead); waiting there for work is idle time."""
    import time as real_time

    def slow_read(wait: float) -> list:
        real_time.sleep(0.05)
        return []

    busy = make_worker([], [])
    busy.inbox = SimpleNamespace(receive=slow_read)
    busy._turn()
    assert busy.forward_turn_seconds >= 0.05
    idle = make_worker([], [])
    idle.inbox = SimpleNamespace(receive=slow_read)
    idle.role.has_work = False  # the loop waits up to wait_s in the read
    idle._turn()
    assert idle.num_forwards == 1 and idle.forward_turn_seconds < 0.05


def test_a_forward_log_gets_one_line_per_forward(tmp_path):
    from common.engine.forward_log import ForwardLog, read

    worker = make_worker([], [])
    worker.forward_log = ForwardLog(str(tmp_path), "coupled-0")
    worker._turn()
    worker.forward_log.close()
    lines = read(tmp_path / "coupled-0.jsonl")
    assert len(lines) == 1 and lines[0]["forward_s"] == 5.0  # the fake forward's seconds
    assert lines[0]["turn_s"] == pytest.approx(worker.forward_turn_seconds)
    assert lines[0]["shape"].tokens == 0  # the fake plan has no chunks
