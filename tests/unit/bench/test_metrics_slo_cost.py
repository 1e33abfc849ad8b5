"""bench.metrics additions: SLO attainment, goodput, resource usage from /cluster, perf/$."""

from __future__ import annotations

import pytest

from bench.client import RequestRecord
from bench.metrics import (
    cost_report,
    goodput,
    meets_slo,
    perf_per_dollar,
    resource_usage,
    summarize,
    wall_usage,
)


def record(index, ttft, gaps, error=None, output_tokens=None):
    times = [1.0 + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(index, 1.0, ttft, times, times[-1] - 1.0, 10,
                         output_tokens or len(times), error=error)


def test_a_request_meets_the_slo_only_if_ttft_and_its_gaps_do():
    assert meets_slo(record(0, 0.1, [0.05] * 10), ttft_slo_s=0.2, tbt_slo_s=0.06)
    assert not meets_slo(record(0, 0.3, [0.05] * 10), 0.2, 0.06)  # TTFT
    assert not meets_slo(record(0, 0.1, [0.05] * 9 + [0.5]), 0.2, 0.06, tbt_percentile=100)
    # at p99 one slow gap in 200 is tolerated, one in 10 is not
    assert meets_slo(record(0, 0.1, [0.05] * 199 + [0.5]), 0.2, 0.06)
    assert not meets_slo(record(0, 0.1, [0.05] * 9 + [0.5]), 0.2, 0.06)
    assert meets_slo(record(0, 0.1, []), 0.2, 0.06)  # one token: no gap to judge
    assert not meets_slo(record(0, 0.1, [0.01], error="boom"), 0.2, 0.06)


def test_goodput_counts_failures_as_misses():
    records = [record(0, 0.1, [0.05] * 3), record(1, 0.5, [0.05] * 3),
               record(2, 0.1, [0.05] * 3, error="HTTP 500"), record(3, 0.1, [0.01])]
    result = goodput(records, duration_s=2.0, ttft_slo_s=0.2, tbt_slo_s=0.06)
    assert result["num_met"] == 2 and result["fraction"] == 0.5
    assert result["requests_per_s"] == 1.0 and result["output_tokens_per_s"] == (4 + 2) / 2.0
    assert goodput([], 0.0, 1.0, 1.0)["fraction"] is None


def cluster(**busy):
    return {"instances": [{"instance_id": k, "role": "coupled", "busy_seconds": v}
                          for k, v in busy.items()]}


def test_resource_usage_is_the_busy_time_added_during_the_run():
    usage = resource_usage(cluster(p=10.0, d=4.0, gone=1.0), cluster(p=13.5, d=6.0, new=0.5))
    assert usage["per_instance"] == {"p": 3.5, "d": 2.0, "new": 0.5}
    assert usage["instance_seconds"] == pytest.approx(6.0)
    assert usage["num_instances"] == 3 and usage["num_lost"] == 1
    lists = resource_usage(cluster(a=1.0)["instances"], cluster(a=3.0)["instances"])
    assert lists["instance_seconds"] == 2.0


def test_every_instance_pays_the_run_wall_time_from_when_it_is_ready():
    before = cluster(p=10.0, d=4.0, gone=1.0)
    after = {"instances": [{"instance_id": "p", "busy_seconds": 11.0, "uptime_s": 500.0},
                           {"instance_id": "d", "busy_seconds": 4.0, "uptime_s": 500.0},
                           {"instance_id": "late", "busy_seconds": 0.5, "uptime_s": 3.0},
                           {"instance_id": "unknown", "busy_seconds": 0.5}]}
    usage = wall_usage(before, after, wall_seconds=20.0)
    # idle "d" pays like busy "p"; "late" from its first report; "gone" (lost) to the end; an
    # answer without uptime charges the whole run
    assert usage["per_instance"] == {"p": 20.0, "d": 20.0, "late": 3.0, "unknown": 20.0,
                                     "gone": 20.0}
    assert usage["instance_seconds"] == 83.0 and usage["num_instances"] == 5


def test_perf_per_dollar_is_output_tokens_per_costed_instance_second():
    assert perf_per_dollar(600, 3.0) == 200.0
    assert perf_per_dollar(600, 3.0, cost_per_instance_second=2.0) == 100.0
    assert perf_per_dollar(600, 0.0) is None
    records = [record(0, 0.1, [0.05] * 5)]
    summary = summarize(records, 1.0)
    tokens = summary["total_output_tokens"]
    # two instances over a 10 s run, busy 3 s and 1 s: paid 20 instance-seconds, busy 4
    report = cost_report(summary, cluster(a=1.0, b=0.0), cluster(a=4.0, b=1.0), wall_seconds=10.0)
    assert report["perf_per_dollar"] == tokens / 20.0
    assert report["perf_per_busy_dollar"] == tokens / 4.0
    assert report["wall_usage"]["instance_seconds"] == 20.0
    priced = cost_report(summary, cluster(a=1.0), cluster(a=4.0), wall_seconds=10.0,
                         cost_per_instance_second=2.0)
    assert priced["perf_per_dollar"] == tokens / 20.0
    # without a wall time, the run's duration (first send to last finish) is paid
    assert cost_report(summary, cluster(a=1.0), cluster(a=4.0))["perf_per_dollar"] == tokens


def test_queueing_delay_is_none_unless_the_server_reports_it():
    records = [record(0, 0.1, [0.05])]
    assert summarize(records, 1.0)["queueing_delay_s"] is None
    assert summarize(records, 1.0, queueing_delays=[0.25])["queueing_delay_s"]["p50"] == 0.25
