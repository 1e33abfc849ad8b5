"""One contract, two stores: the in-process store and a real Redis server behave the same."""

from __future__ import annotations

import time
import uuid

import pytest

from common.protocol import ClusterView, InstanceStats, PeerInfo
from common.store import InProcessStore, StoreUnavailable

REDIS_URL = "redis://127.0.0.1:6379/15"


def _redis_store():
    from common.redis_store import RedisStore

    store = RedisStore(REDIS_URL, prefix=f"test-{uuid.uuid4().hex[:8]}")
    try:
        store.instances()
    except StoreUnavailable:
        pytest.skip("no Redis server answers on 127.0.0.1:6379 (.ci/run starts one)")
    return store


@pytest.fixture(params=["memory", "redis"])
def store(request):
    s = InProcessStore() if request.param == "memory" else _redis_store()
    yield s
    if request.param == "redis":
        s.clear()
    s.close()


def stats(instance_id, role="prefill", free=10):
    return InstanceStats(instance_id=instance_id, role=role, inbox=f"tcp://h:{len(instance_id)}",
                         kv_endpoint="tcp://h:2", model="m", max_model_len=100,
                         num_total_blocks=10, num_free_blocks=free)


def test_instances_register_update_and_expire(store):
    store.put_instance(stats("a"), ttl_s=0.3)
    store.put_instance(stats("b", "decode"), ttl_s=5)
    store.put_instance(stats("a", free=3), ttl_s=0.3)
    found = {s.instance_id: s for s in store.instances()}
    assert set(found) == {"a", "b"} and found["a"].num_free_blocks == 3
    assert found["b"].role == "decode"
    time.sleep(0.45)
    assert [s.instance_id for s in store.instances()] == ["b"]
    store.remove_instance("b")
    assert store.instances() == []


def test_publish_reaches_every_subscriber_in_order(store):
    first, second = store.subscribe("view"), store.subscribe("view")
    other = store.subscribe("elsewhere")
    first.poll(0.05)  # redis subscribes lazily on the first poll
    second.poll(0.05)
    other.poll(0.05)
    views = [ClusterView([PeerInfo(f"d{i}", "tcp://x", "tcp://y")], float(i)) for i in range(3)]
    for view in views:
        store.publish("view", view)
    for sub in (first, second):
        got = []
        deadline = time.monotonic() + 2
        while len(got) < 3 and time.monotonic() < deadline:
            got += sub.poll(0.1)
        assert got == views
    assert other.poll(0.1) == []
    for sub in (first, second, other):
        sub.close()


def test_request_table_lifecycle(store):
    store.put_request("r1", {"arrival": 1.5, "phase": "queued", "prefill_instance": "p0"})
    store.put_request("r1", {"phase": "decoding", "decode_instance": "d0"})
    store.put_request("r2", {"phase": "queued"})
    assert sorted(store.in_flight_requests()) == ["r1", "r2"]
    assert store.get_request("r1") == {"arrival": 1.5, "phase": "decoding",
                                       "prefill_instance": "p0", "decode_instance": "d0"}
    store.finish_request("r1", {"phase": "finished"})
    assert store.in_flight_requests() == ["r2"]
    assert store.get_request("r1")["phase"] == "finished"
    assert store.get_request("missing") is None


def test_leadership_is_exclusive_and_expires(store):
    assert store.try_lead("g1", ttl_s=0.3)
    assert not store.try_lead("g2", ttl_s=0.3)
    assert store.try_lead("g1", ttl_s=0.3)  # renewal
    time.sleep(0.45)
    assert store.try_lead("g2", ttl_s=0.3)
    assert not store.try_lead("g1", ttl_s=0.3)


def test_flips_newest_first(store):
    store.record_flip({"instance_id": "a", "to": "decode", "switch_s": 0.001})
    store.record_flip({"instance_id": "b", "to": "prefill", "switch_s": 0.002})
    assert [f["instance_id"] for f in store.flips()] == ["b", "a"]
