"""The in-memory request table: phases, timestamps, final phases and the finished bound."""

from __future__ import annotations

import pytest

from control_plane import request_table
from control_plane.request_table import InMemoryRequestTable, Phase, RequestRecord


class FakeWallClock:
    """Stands in for the `time` module inside control_plane.request_table."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now - 1_699_000_000.0

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeWallClock()
    monkeypatch.setattr(request_table, "time", fake)
    return fake


def record(request_id, arrival=1_699_999_999.0, prompt=10, **fields):
    return RequestRecord(request_id, arrival, prompt, **fields)


def test_phase_finality():
    assert [p for p in Phase if p.is_final] == [Phase.FINISHED, Phase.FAILED, Phase.ABORTED]
    assert Phase("decoding") is Phase.DECODING and Phase.QUEUED == "queued"


def test_create_stamps_the_arrival(clock):
    table = InMemoryRequestTable()
    table.create(record("r1", arrival=123.5, sla_ttft_s=0.5))
    rec = table.get("r1")
    assert rec.phase is Phase.QUEUED and rec.timestamps == {"queued": 123.5}
    assert rec.sla_ttft_s == 0.5
    assert table.in_flight() == [rec]


def test_phases_are_stamped_and_instances_recorded(clock):
    table = InMemoryRequestTable()
    table.create(record("r1", arrival=clock.now))
    clock.advance(0.25)
    table.advance("r1", Phase.PREFILLED, prefill_instance="prefill-0")
    clock.advance(1.5)
    table.advance("r1", Phase.DECODING, decode_instance="decode-1")
    rec = table.get("r1")
    assert rec.phase is Phase.DECODING
    assert rec.prefill_instance == "prefill-0" and rec.decode_instance == "decode-1"
    t0 = clock.now - 1.75
    assert rec.timestamps == {"queued": t0, "prefilled": t0 + 0.25, "decoding": t0 + 1.75}
    assert table.in_flight() == [rec] and not table.finished
    clock.advance(2.0)
    table.advance("r1", Phase.FINISHED)
    assert rec.timestamps["finished"] == t0 + 3.75
    assert rec.as_dict()["phase"] == "finished"
    assert rec.as_dict()["timestamps"] == rec.timestamps
    assert rec.as_dict()["decode_instance"] == "decode-1"


@pytest.mark.parametrize("final", [Phase.FINISHED, Phase.FAILED, Phase.ABORTED])
def test_final_phases_move_records_to_finished(clock, final):
    table = InMemoryRequestTable()
    table.create(record("r1"))
    table.create(record("r2"))
    table.advance("r1", final)
    assert [r.request_id for r in table.in_flight()] == ["r2"]
    assert list(table.finished) == ["r1"] and "r1" not in table.active
    assert table.get("r1").phase is final  # still findable
    # a finished record no longer changes
    table.advance("r1", Phase.DECODING, decode_instance="late")
    assert table.get("r1").phase is final and table.get("r1").decode_instance == ""


def test_non_final_phases_stay_in_flight(clock):
    table = InMemoryRequestTable()
    table.create(record("r1"))
    for phase in (Phase.PREFILLED, Phase.DECODING):
        table.advance("r1", phase)
        assert [r.request_id for r in table.in_flight()] == ["r1"] and not table.finished


def test_unknown_request_is_ignored(clock):
    table = InMemoryRequestTable()
    table.advance("ghost", Phase.FINISHED)
    assert table.get("ghost") is None and not table.finished and table.in_flight() == []


def test_keep_finished_bounds_the_finished_records(clock):
    table = InMemoryRequestTable(keep_finished=2)
    for i in range(5):
        table.create(record(f"r{i}"))
    for i in (3, 0, 4, 1):
        table.advance(f"r{i}", Phase.FINISHED)
    assert list(table.finished) == ["r4", "r1"]  # the oldest finished are dropped first
    assert table.get("r3") is None and table.get("r0") is None
    assert [r.request_id for r in table.in_flight()] == ["r2"]
    assert len(table.finished) <= 2


def test_keep_finished_zero_keeps_none(clock):
    table = InMemoryRequestTable(keep_finished=0)
    table.create(record("r1"))
    table.advance("r1", Phase.ABORTED)
    assert table.get("r1") is None and table.in_flight() == []


def test_in_flight_lists_active_records_in_creation_order(clock):
    table = InMemoryRequestTable()
    for rid in ("c", "a", "b"):
        table.create(record(rid))
    table.advance("a", Phase.DECODING)
    assert [r.request_id for r in table.in_flight()] == ["c", "a", "b"]
    in_flight = table.in_flight()
    in_flight.clear()  # a copy: clearing it does not touch the table
    assert len(table.in_flight()) == 3
