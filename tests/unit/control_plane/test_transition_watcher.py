"""Flip policies as pure functions on hand-built pool snapshots, and the watcher's hysteresis."""

from __future__ import annotations

import pytest

from common.config import ConfigError
from common.protocol import InstanceStats
from control_plane.transition import (
    IdlePolicy,
    LoadRatioPolicy,
    PoolSnapshot,
    QueueDelayPolicy,
    TransitionWatcher,
    make_watcher,
)


def inst(instance_id, role, queued=0, running=0, waiting=0):
    return InstanceStats(instance_id=instance_id, role=role, inbox="", kv_endpoint="", model="m",
                         max_model_len=10, num_total_blocks=10, num_free_blocks=10,
                         num_queued_tokens=queued, num_running=running, num_waiting=waiting)


def snap(now, *instances, ttft=None):
    return PoolSnapshot(now, list(instances), ttft)


def test_load_ratio_moves_the_idlest_instance_to_the_heavy_pool():
    policy = LoadRatioPolicy(ratio=3, prefill_capacity_tokens=100, decode_capacity_seqs=10)
    decode_heavy = snap(0, inst("p0", "prefill", queued=10), inst("p1", "prefill", queued=0),
                        inst("d0", "decode", running=9))
    assert policy.decide(decode_heavy).instance_id == "p1"
    prefill_heavy = snap(0, inst("p0", "prefill", queued=500), inst("d0", "decode", running=1),
                         inst("d1", "decode", running=0))
    decision = policy.decide(prefill_heavy)
    assert (decision.instance_id, decision.target_role) == ("d1", "prefill")
    balanced = snap(0, inst("p0", "prefill", queued=100), inst("d0", "decode", running=10))
    assert policy.decide(balanced) is None


def test_idle_policy_waits_for_the_idle_time():
    policy = IdlePolicy(idle_s=60)
    cluster = [inst("p0", "prefill"), inst("p1", "prefill", queued=5, waiting=1),
               inst("d0", "decode", running=3)]
    assert policy.decide(snap(0, *cluster)) is None
    assert policy.decide(snap(59, *cluster)) is None
    decision = policy.decide(snap(61, *cluster))
    assert (decision.instance_id, decision.target_role) == ("p0", "decode")


def test_queue_delay_policy():
    policy = QueueDelayPolicy(ttft_target_s=1.0, decode_capacity_seqs=4)
    cluster = [inst("p0", "prefill"), inst("d0", "decode", running=1),
               inst("d1", "decode", running=0)]
    assert policy.decide(snap(0, *cluster, ttft=2.0)).instance_id == "d1"
    assert policy.decide(snap(0, *cluster, ttft=0.5)) is None
    busy = [inst("p0", "prefill"), inst("p1", "prefill", queued=9), inst("d0", "decode",
                                                                         running=8)]
    decision = policy.decide(snap(0, *busy, ttft=0.1))
    assert (decision.instance_id, decision.target_role) == ("p0", "decode")


def test_watcher_requires_sustained_condition_cooldown_and_never_empties_a_pool():
    watcher = TransitionWatcher(LoadRatioPolicy(ratio=2, prefill_capacity_tokens=10,
                                                decode_capacity_seqs=1),
                                cooldown_s=10, sustain_ticks=3)
    heavy = [inst("p0", "prefill"), inst("p1", "prefill"), inst("d0", "decode", running=5)]
    assert watcher.step(snap(0, *heavy), False) is None
    assert watcher.step(snap(1, *heavy), False) is None
    assert watcher.step(snap(2, *heavy), False).target_role == "decode"
    for t in (3, 4, 5, 6):  # cooling down
        assert watcher.step(snap(t, *heavy), False) is None
    assert watcher.step(snap(13, *heavy), True) is None  # a flip is still in flight
    lone = [inst("p0", "prefill"), inst("d0", "decode", running=5)]
    for t in range(30, 40):
        assert watcher.step(snap(t, *lone), False) is None  # p0 is the only prefill


def test_make_watcher_options():
    watcher = make_watcher("idle", idle_s=5.0, cooldown_s=1.0, sustain_ticks=2.0)
    assert watcher.cooldown_s == 1.0 and watcher.sustain_ticks == 2
    assert watcher.policy.idle_s == 5.0
    with pytest.raises(ConfigError):
        make_watcher("idle", bogus=1.0)
    with pytest.raises(ConfigError):
        make_watcher("telepathy")
