"""What the monitor's ClusterView tells dispatchers: decode loads with offers in flight counted,
and no placement from a partial view while the launched cluster is still starting."""

from __future__ import annotations

from common.protocol import ClusterView, InstanceStats, PeerInfo
from common.store import InProcessStore
from control_plane.cluster import InstanceRegistry, decode_peer
from control_plane.monitor import ClusterMonitor

from unit.role_fixtures import FakeOutbox


def stats(instance_id, role="decode", **extra) -> InstanceStats:
    return InstanceStats(instance_id, role, f"tcp://{instance_id}", "", "m", 2048,
                         num_total_blocks=100, num_free_blocks=extra.pop("free", 80), **extra)


def test_a_decode_peer_counts_offers_waiting_and_being_read():
    report = stats("d0", free=60, num_running=3, num_heavy_decodes=1, num_light_decodes=2,
                   num_waiting=2, num_transferring=1, num_incoming_heavy=2,
                   num_incoming_light=1, num_reserved_blocks=9, offers_seen={"p0": 41},
                   timestamp=123.5)
    assert decode_peer(report) == PeerInfo(
        "d0", "tcp://d0", "", num_free_blocks=51, num_total_blocks=100, num_running=6,
        num_waiting=2, num_heavy=3, num_light=3, offers_seen={"p0": 41}, report_time=123.5)
    # blocks reserved past the free ones: no room, never negative
    assert decode_peer(stats("d1", free=4, num_reserved_blocks=7)).num_free_blocks == 0


def monitor_with(registry: InstanceRegistry) -> tuple[ClusterMonitor, FakeOutbox]:
    outbox = FakeOutbox()
    return ClusterMonitor(registry, InProcessStore(), outbox, "g0", 0.1, None,
                          lambda removed: None), outbox


def views_to(outbox: FakeOutbox, inbox: str) -> list[ClusterView]:
    return [m for address, m in outbox.sent if address == inbox and isinstance(m, ClusterView)]


def test_views_are_incomplete_until_every_launched_instance_reported():
    registry = InstanceRegistry(instance_timeout_s=5.0)
    registry.expect(["prefill-0", "decode-0", "decode-1"])
    monitor, outbox = monitor_with(registry)
    monitor.on_stats(stats("prefill-0", role="prefill"))
    monitor.on_stats(stats("decode-0"))
    first, = views_to(outbox, "tcp://prefill-0")
    assert [p.instance_id for p in first.decodes] == ["decode-0"] and not first.complete
    assert not registry.is_serving()  # /health says 503 and nothing is routed yet
    monitor.on_stats(stats("decode-1"))
    last = views_to(outbox, "tcp://prefill-0")[-1]
    assert last.complete and [p.instance_id for p in last.decodes] == ["decode-0", "decode-1"]
    assert registry.is_serving()
    # a decode instance lost later leaves a complete view with fewer decodes (not a start-up)
    del registry.instances["decode-1"]
    monitor._broadcast()
    assert views_to(outbox, "tcp://prefill-0")[-1].complete


def test_a_gateway_without_expectations_sends_complete_views():
    registry = InstanceRegistry(instance_timeout_s=5.0)
    monitor, outbox = monitor_with(registry)
    monitor.on_stats(stats("prefill-0", role="prefill"))
    monitor.on_stats(stats("decode-0"))
    assert views_to(outbox, "tcp://prefill-0")[-1].complete
    # an instance that had reported before `expect` is not awaited
    registry.expect(["decode-0", "decode-9"])
    assert registry.awaiting == {"decode-9"}
