"""The gateway's instance registry: registration, readiness, least-loaded choice, descriptions."""

from __future__ import annotations

import pytest

from common.protocol import InstanceStats, PeerInfo
from control_plane import cluster
from control_plane.cluster import InstanceRegistry

TIMEOUT = 0.5


class FakeClock:
    """Stands in for the `time` module inside control_plane.cluster."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.7e9 + self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(cluster, "time", fake)
    return fake


@pytest.fixture
def registry(clock):
    return InstanceRegistry(instance_timeout_s=TIMEOUT)


def stats(instance_id, role="prefill", queued=0, waiting=0, running=0, free=80, total=100,
          **extra):
    return InstanceStats(instance_id, role, f"tcp://{instance_id}:1", f"tcp://{instance_id}:2",
                         "some/model", 2048, num_total_blocks=total, num_free_blocks=free,
                         num_waiting=waiting, num_running=running, num_queued_tokens=queued,
                         **extra)


def test_first_report_registers(registry):
    assert registry.report(stats("p0")) is True
    assert registry.report(stats("p0", queued=5)) is False
    state = registry.get("p0")
    assert state.stats.num_queued_tokens == 5  # the latest report replaces the old one
    assert registry.get("nobody") is None
    assert list(registry.instances) == ["p0"]


def test_role_change_counts_as_new(registry):
    registry.report(stats("x", role="prefill"))
    assert registry.report(stats("x", role="decode")) is True
    assert registry.ready("prefill") == [] and len(registry.ready("decode")) == 1


def test_readiness_expires_and_comes_back(registry, clock):
    registry.report(stats("p0"))
    state = registry.get("p0")
    assert registry.is_ready(state)
    clock.advance(TIMEOUT)  # exactly at the limit: still ready
    assert registry.is_ready(state)
    clock.advance(0.001)
    assert not registry.is_ready(state)
    assert registry.ready("prefill") == [] and registry.least_loaded_prefill() is None
    assert registry.get("p0") is state  # not ready, but still known
    registry.report(stats("p0"))
    assert registry.is_ready(state) and registry.ready("prefill") == [state]


def test_is_ready_with_explicit_now(registry, clock):
    registry.report(stats("p0"))
    state = registry.get("p0")
    assert registry.is_ready(state, now=clock.now + TIMEOUT)
    assert not registry.is_ready(state, now=clock.now + TIMEOUT + 0.01)


def test_is_serving_needs_a_ready_instance_of_each_role(registry, clock):
    assert not registry.is_serving()
    registry.report(stats("p0", role="prefill"))
    assert not registry.is_serving()
    clock.advance(0.4)
    registry.report(stats("d0", role="decode"))
    assert registry.is_serving()
    clock.advance(0.2)  # the prefill goes silent past the timeout
    assert not registry.is_serving()
    registry.report(stats("p1", role="prefill"))
    assert registry.is_serving()


def test_least_loaded_prefill_by_queued_tokens(registry):
    registry.report(stats("p0", queued=500))
    registry.report(stats("p1", queued=100))
    registry.report(stats("p2", queued=300))
    registry.report(stats("d0", role="decode", queued=0))  # decodes are never chosen
    assert registry.least_loaded_prefill().stats.instance_id == "p1"


def test_least_loaded_counts_tokens_sent_since_the_last_report(registry):
    registry.report(stats("d0", role="decode"))  # prefill is routable only with a decode
    registry.report(stats("p0", queued=100))
    registry.report(stats("p1", queued=150))
    p0 = registry.least_loaded_prefill()
    assert p0.stats.instance_id == "p0"
    registry.note_sent(p0, 80)  # 180 vs 150
    assert p0.sent_tokens_since_report == 80 and p0.sent_requests_since_report == 1
    p1 = registry.least_loaded_prefill()
    assert p1.stats.instance_id == "p1"
    registry.note_sent(p1, 10)  # 180 vs 160
    registry.note_sent(p1, 10)  # 180 vs 170
    assert registry.least_loaded_prefill() is p1
    assert p1.sent_requests_since_report == 2


def test_report_resets_sent_counters(registry):
    registry.report(stats("d0", role="decode"))  # prefill is routable only with a decode
    registry.report(stats("p0", queued=0))
    registry.report(stats("p1", queued=50))
    p0 = registry.get("p0")
    registry.note_sent(p0, 100)
    assert registry.least_loaded_prefill().stats.instance_id == "p1"
    registry.report(stats("p0", queued=10))  # the report now includes what was sent
    assert (p0.sent_tokens_since_report, p0.sent_requests_since_report) == (0, 0)
    assert registry.least_loaded_prefill() is p0


def test_a_repeated_report_keeps_what_was_sent_since(registry, clock):
    """The store hands back an instance's last report on every sync until it writes a new one,
    which it cannot do during a long forward. Golden case from the HPLD plan check: two idle
    co-located instances, a 1,281-token prompt sent to c0, then a second prompt 0.5 s later
    while c0 prefills the first. Taking the repeated report as new dropped c0's count, both
    looked idle, and the tie sent the second prompt behind the first."""
    c0 = stats("c0", role="coupled", timestamp=10.0)
    c1 = stats("c1", role="coupled", timestamp=10.0)
    registry.sync([c0, c1])
    first = registry.least_loaded_prefill()
    assert first.stats.instance_id == "c0"  # the tie: by id
    registry.note_sent(first, 1281)
    clock.advance(0.5)
    registry.sync([c0, c1])  # nothing new in the store: the same two reports
    assert (first.sent_tokens_since_report, first.sent_requests_since_report) == (1281, 1)
    assert registry.least_loaded_prefill().stats.instance_id == "c1"
    assert first.last_seen == clock.now  # still present in the store: alive
    registry.sync([stats("c0", role="coupled", queued=1281, timestamp=10.2), c1])
    assert first.sent_tokens_since_report == 0  # a new report: it counts the prompt itself
    assert first.stats.num_queued_tokens == 1281
    assert registry.least_loaded_prefill().stats.instance_id == "c1"


GATEWAY = "tcp://gateway:7000"


def test_a_send_stays_counted_until_a_report_has_seen_it(registry):
    """The echo: a report made before a request arrived (in flight, or still in the instance's
    inbox behind a long forward) does not clear it; the report that has seen it does."""
    registry.address = GATEWAY
    registry.report(stats("c0", role="coupled", timestamp=1.0, requests_seen={GATEWAY: 3}))
    registry.report(stats("c1", role="coupled", timestamp=1.0))
    c0 = registry.get("c0")
    registry.note_sent(c0, 600)  # the instance's 4th request from this gateway
    registry.note_sent(c0, 50)   # its 5th
    registry.report(stats("c0", role="coupled", timestamp=1.1, requests_seen={GATEWAY: 3}))
    assert (c0.sent_tokens_since_report, c0.sent_requests_since_report) == (650, 2)
    assert registry.least_loaded_prefill().stats.instance_id == "c1"
    registry.report(stats("c0", role="coupled", timestamp=1.2, queued=600,
                          requests_seen={GATEWAY: 4, "tcp://other:1": 9}))
    assert (c0.sent_tokens_since_report, c0.sent_requests_since_report) == (50, 1)
    registry.report(stats("c0", role="coupled", timestamp=1.3, requests_seen={GATEWAY: 5}))
    assert (c0.sent_tokens_since_report, c0.sent_requests_since_report) == (0, 0)


def test_a_restarted_instance_counts_from_zero(registry):
    registry.address = GATEWAY
    registry.report(stats("p0", timestamp=1.0, pid=10, requests_seen={GATEWAY: 7}))
    p0 = registry.get("p0")
    registry.note_sent(p0, 100)
    registry.report(stats("p0", timestamp=2.0, pid=11))  # a new process, same id
    assert p0.sent_tokens_since_report == 0 and p0.num_sent == 0
    registry.note_sent(p0, 30)
    registry.report(stats("p0", timestamp=2.1, pid=11, requests_seen={GATEWAY: 1}))
    assert p0.sent_tokens_since_report == 0


def test_a_report_without_timestamp_is_always_new(registry):
    registry.report(stats("d0", role="decode"))
    registry.report(stats("p0"))
    p0 = registry.get("p0")
    registry.note_sent(p0, 100)
    registry.report(stats("p0", queued=100))
    assert p0.sent_tokens_since_report == 0


def test_least_loaded_ties_broken_by_waiting_then_id(registry):
    registry.report(stats("d0", role="decode"))  # prefill is routable only with a decode
    registry.report(stats("p1", queued=10, waiting=1))
    registry.report(stats("p0", queued=10, waiting=1))
    registry.report(stats("p2", queued=10, waiting=0))
    assert registry.least_loaded_prefill().stats.instance_id == "p2"
    registry.note_sent(registry.get("p2"), 0)  # a zero-token request still counts as queued
    assert registry.least_loaded_prefill().stats.instance_id == "p0"


def test_least_loaded_skips_instances_that_are_not_ready(registry, clock):
    registry.report(stats("idle", queued=0))
    clock.advance(0.3)
    registry.report(stats("busy", queued=1000))
    registry.report(stats("d0", role="decode"))
    clock.advance(0.3)  # "idle" last reported 0.6 s ago
    assert registry.least_loaded_prefill().stats.instance_id == "busy"


def test_decode_peers_lists_only_ready_decodes(registry, clock):
    registry.report(stats("d-old", role="decode"))
    clock.advance(0.3)
    registry.report(stats("d1", role="decode", free=30, total=64, running=5, waiting=2))
    registry.report(stats("p0", role="prefill"))
    clock.advance(0.3)
    peers = registry.decode_peers()
    assert peers == [PeerInfo("d1", "tcp://d1:1", "tcp://d1:2", num_free_blocks=30,
                              num_total_blocks=64, num_running=5, num_waiting=2)]
    assert all(type(p) is PeerInfo for p in peers)
    clock.advance(1.0)
    assert registry.decode_peers() == []


def test_describe_fields(registry, clock):
    registry.report(stats("p1", queued=42, waiting=3, running=2, free=30, total=100,
                          num_transferring=4, busy_seconds=1.23456, pid=777,
                          prefix_query_tokens=300, prefix_hit_tokens=96, num_cached_blocks=12,
                          dtype="bfloat16", num_threads=2))
    registry.report(stats("d0", role="decode", free=10, total=64))
    clock.advance(0.25)
    rows = registry.describe()
    assert [r["instance_id"] for r in rows] == ["d0", "p1"]  # sorted by id
    p1 = rows[1]
    assert p1 == {
        "instance_id": "p1", "role": "prefill", "ready": True, "draining": False,
        "flip_target": None, "decodes": {"heavy": 0, "light": 0, "finished_heavy": 0,
                                           "finished_light": 0, "preemptions": 0,
                                           "first_admit_time": 0.0, "last_finish_time": 0.0}, "inbox": "tcp://p1:1",
        "kv_endpoint": "tcp://p1:2", "pid": 777, "model": "some/model", "metrics_url": None,
        "dtype": "bfloat16", "threads": 2,
        "queue": {"waiting": 3, "running": 2, "transferring": 4, "queued_tokens": 42},
        "kv_blocks": {"total": 100, "free": 30, "used": 70, "cached": 12},
        "prefix_cache": {"query_tokens": 300, "hit_tokens": 96, "hit_rate": 0.32,
                         "blocks_read": 0, "blocks_skipped": 0, "local_prefills": 0},
        "policy": {}, "busy_seconds": 1.235, "num_forwards": 0, "forward_turn_seconds": 0.0,
        "uptime_s": 0.25, "seconds_since_report": 0.25}
    assert rows[0]["kv_blocks"] == {"total": 64, "free": 10, "used": 54, "cached": 0}
    assert rows[0]["dtype"] is None and rows[0]["threads"] is None  # not said
    clock.advance(1.0)
    assert [r["ready"] for r in registry.describe()] == [False, False]
    assert registry.describe()[0]["seconds_since_report"] == 1.25


def test_sync_expire_and_flipping(registry, clock):
    registry.report(stats("p0"))
    registry.report(stats("p1"))
    registry.report(stats("d0", role="decode"))
    assert registry.sync([stats("p0"), stats("d0", role="decode")]) == []  # grace period
    clock.advance(1.5)
    assert registry.sync([stats("p0"), stats("d0", role="decode")]) == ["p1"]
    registry.mark_flipping("p0", "decode")
    assert registry.routable("prefill") == [] and not registry.is_serving()
    registry.report(stats("p0", role="decode"))  # the flip completed
    assert not registry.get("p0").draining
    clock.advance(5.0)
    registry.touch_all()
    assert registry.expire() == []
    clock.advance(5.0)
    assert sorted(registry.expire()) == ["d0", "p0"]


def test_coupled_instances_serve_alone_and_prefill_needs_a_decode(registry):
    registry.report(stats("p0"))
    assert registry.least_loaded_prefill() is None and not registry.is_serving()
    registry.report(stats("c0", role="coupled"))
    assert registry.is_serving()
    assert registry.least_loaded_prefill().stats.instance_id == "c0"


def ids(states) -> list[str]:
    return [s.stats.instance_id for s in states]


def test_routable_follows_every_change_of_membership_role_and_draining(registry, clock):
    """Routing reads routable lists kept between changes: each kind of change shows at once."""
    for name, role in [("p0", "prefill"), ("d0", "decode"), ("p1", "prefill")]:
        registry.report(stats(name, role=role))
    assert ids(registry.routable("prefill")) == ["p0", "p1"]
    registry.routable("prefill").clear()  # a caller's list is its own
    assert ids(registry.entry_points()) == ["p0", "p1"]
    registry.report(stats("p1", role="prefill", timestamp=1.0, draining=True))
    assert ids(registry.routable("prefill")) == ["p0"]
    registry.report(stats("p1", role="prefill", timestamp=2.0))  # draining ended
    assert ids(registry.routable("prefill")) == ["p0", "p1"]
    registry.mark_flipping("p0", "decode")
    assert ids(registry.routable("prefill")) == ["p1"] and registry.routable("decode") != []
    registry.report(stats("p0", role="decode", timestamp=3.0))  # the flip completed
    assert ids(registry.routable("decode")) == ["p0", "d0"]  # in registration order
    del registry.instances["d0"]  # removed behind the registry's back
    assert ids(registry.routable("decode")) == ["p0"]
    clock.advance(1.0)  # not ready: filtered at the read, no report needed
    assert registry.routable("decode") == []
    registry.managed_by_store = True
    assert ids(registry.routable("decode")) == ["p0"]
    assert registry.sync([stats("p1")]) == ["p0"]  # gone from the store for too long
    assert registry.routable("decode") == [] and ids(registry.routable("prefill")) == ["p1"]
