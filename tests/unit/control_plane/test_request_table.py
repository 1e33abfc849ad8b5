"""The request status table over the in-process store: phases, timestamps, final phases."""

from __future__ import annotations

import pytest

from common import store as store_module
from common.store import InProcessStore
from control_plane.request_table import Phase, RequestRecord, RequestTable


@pytest.fixture
def table():
    return RequestTable(InProcessStore(), background=False)


def test_phase_finality():
    assert [p for p in Phase if p.is_final] == [Phase.FINISHED, Phase.FAILED, Phase.ABORTED]
    assert Phase("decoding") is Phase.DECODING and Phase.QUEUED == "queued"


def test_lifecycle_is_stamped_and_records_instances(table):
    table.create(RequestRecord("r1", 100.0, 12, prefill_instance="p0"))
    table.advance("r1", Phase.PREFILLED)
    table.advance("r1", Phase.DECODING, decode_instance="d1")
    record = table.get("r1")
    assert record.phase is Phase.DECODING and record.prefill_instance == "p0"
    assert record.decode_instance == "d1" and record.num_prompt_tokens == 12
    assert record.timestamps["queued"] == 100.0
    assert record.timestamps["queued"] < record.timestamps["prefilled"] <= \
        record.timestamps["decoding"]
    assert table.in_flight() == ["r1"]


@pytest.mark.parametrize("final", [Phase.FINISHED, Phase.FAILED, Phase.ABORTED])
def test_final_phases_leave_the_in_flight_set(table, final):
    table.create(RequestRecord("r1", 1.0, 3))
    table.create(RequestRecord("r2", 2.0, 3))
    table.advance("r1", final)
    assert table.in_flight() == ["r2"] and table.get("r1").phase is final


def test_finished_records_are_bounded(table, monkeypatch):
    monkeypatch.setattr(store_module, "MAX_FINISHED_REQUESTS", 3)
    for i in range(5):
        table.create(RequestRecord(f"r{i}", float(i), 1))
        table.advance(f"r{i}", Phase.FINISHED)
    assert table.get("r0") is None and table.get("r1") is None
    assert table.get("r4").phase is Phase.FINISHED


def test_unknown_request_reads_as_none(table):
    assert table.get("nope") is None
