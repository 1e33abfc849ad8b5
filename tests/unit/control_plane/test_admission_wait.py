"""The gateway's time-based prefill bound: measured speed per instance, estimated wait, 429."""

from __future__ import annotations

import pytest

from common.config import LimitsConfig
from control_plane.admission import Admission, TooBusyError
from control_plane.cluster import RATE_SMOOTHING, InstanceRegistry
from tests.unit.control_plane.test_cluster_registry import clock, stats  # noqa: F401


@pytest.fixture
def registry(clock):  # noqa: F811
    return InstanceRegistry(instance_timeout_s=5.0)


def report(registry, instance_id, busy, tokens, queued=0, role="prefill"):
    registry.report(stats(instance_id, role=role, queued=queued, busy_seconds=busy,
                          num_computed_tokens=tokens))


def test_rate_is_learned_from_busy_time_and_smoothed(registry):
    report(registry, "p0", busy=0.0, tokens=0)
    assert registry.get("p0").queued_seconds is None  # nothing measured yet
    report(registry, "p0", busy=1.0, tokens=1000)
    assert registry.get("p0").tokens_per_busy_second == pytest.approx(1000)
    report(registry, "p0", busy=1.0, tokens=1000)  # a repeated report: no forward time passed
    assert registry.get("p0").tokens_per_busy_second == pytest.approx(1000)
    report(registry, "p0", busy=2.0, tokens=1500, queued=1000)  # slower now: 500 tokens/s
    rate = (1 - RATE_SMOOTHING) * 1000 + RATE_SMOOTHING * 500
    assert registry.get("p0").tokens_per_busy_second == pytest.approx(rate)
    assert registry.get("p0").queued_seconds == pytest.approx(1000 / rate)


def test_a_role_change_forgets_the_rate(registry):
    report(registry, "x", busy=0.0, tokens=0)
    report(registry, "x", busy=1.0, tokens=100)
    report(registry, "x", busy=1.5, tokens=5000, role="decode")
    assert registry.get("x").tokens_per_busy_second == 0.0


def test_admission_refuses_when_the_least_loaded_queue_is_too_long(registry):
    admission = Admission(LimitsConfig(max_prefill_queue_s=2.0), registry)
    for name in ("p0", "p1"):
        report(registry, name, busy=0.0, tokens=0)
        report(registry, name, busy=1.0, tokens=1000)  # 1000 tokens/s each
    report(registry, "p0", busy=1.0, tokens=1000, queued=5000)  # 5 s of work
    report(registry, "p1", busy=1.0, tokens=1000, queued=1500)  # 1.5 s: room left
    admission.check_room("client")
    registry.note_sent(registry.get("p1"), 600)  # sent since its report: 2.1 s now
    with pytest.raises(TooBusyError, match="about 2.1 s of work"):
        admission.check_room("client")


def test_admission_admits_while_no_speed_is_known(registry):
    admission = Admission(LimitsConfig(max_prefill_queue_s=0.5), registry)
    report(registry, "p0", busy=0.0, tokens=0, queued=100000)
    admission.check_room("client")  # cannot estimate: does not refuse on this ground
