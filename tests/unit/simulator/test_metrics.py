"""The simulator's metrics are `splitserve bench`'s: same keys, same values as bench.metrics
computes from per-request records of the same run (failures included)."""

from __future__ import annotations

import pytest

from bench.client import RequestRecord
from bench.metrics import goodput as bench_goodput
from bench.metrics import run_duration as bench_duration
from bench.metrics import summarize as bench_summarize
from simulator.cluster import SimCluster
from simulator.metrics import goodput, run_duration, summarize
from simulator.workload import SimRequest, SyntheticShape, synthetic

from unit.simulator.sim_fixtures import COSTS, instance_config, layout


def assert_same(ours, theirs, path="report"):
    if isinstance(theirs, dict):
        assert set(ours) == set(theirs), path
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, float):
        assert ours == pytest.approx(theirs, rel=1e-9), path
    else:
        assert ours == theirs, path


def record(index: int, trace) -> RequestRecord:
    arrival, times = trace.request.arrival_s, list(trace.token_times)
    return RequestRecord(index, arrival, ttft=times[0] - arrival if times else None,
                         token_times=times, jct=trace.finish - arrival,
                         prompt_tokens=trace.request.num_prompt_tokens,
                         output_tokens=len(times), error=trace.error)


def test_summary_and_goodput_equal_bench_metrics_on_the_same_requests():
    requests = synthetic(60, 30.0, 5, SyntheticShape(100, 1.0, 200, 60, 1.0, 200))
    # two prompts too long for the pool (16 blocks of 16 tokens): they fail at once
    requests += [SimRequest("long0", 0.2, 300, 5, 5), SimRequest("long1", 0.7, 400, 5, 5)]
    cluster = SimCluster(layout(1, 2, instance=instance_config(num_blocks=16)), COSTS, requests)
    cluster.run()
    traces = list(cluster.traces.values())
    records = [record(i, t) for i, t in enumerate(traces)]
    duration = run_duration(traces)
    assert duration == pytest.approx(bench_duration(records))
    ours = summarize(traces, duration)
    assert ours["num_errors"] == 2 and ours["num_ok"] == 60
    assert_same(ours, bench_summarize(records, duration))
    for ttft_slo, tbt_slo in [(1.0, 0.1), (0.05, 0.02), (0.2, 0.015)]:
        ours = goodput(traces, duration, ttft_slo, tbt_slo)
        assert ours.pop("ttft_per_prompt_token_s") == 0.0  # bench's bound: one for all prompts
        assert_same(ours, bench_goodput(records, duration, ttft_slo, tbt_slo))


def test_a_prompt_scaled_ttft_bound_admits_exactly_the_requests_under_their_own_bound():
    shape = SyntheticShape(prompt_median=200, prompt_sigma=1.0, max_prompt_tokens=1000,
                           output_median=20, output_sigma=0.5, max_output_tokens=60)
    requests = synthetic(40, 20.0, 3, shape)
    cluster = SimCluster(layout(1, 1), COSTS, requests)
    cluster.run()
    traces = list(cluster.traces.values())
    base, per_token = 0.02, 2e-4
    expected = sum(t.token_times[0] - t.request.arrival_s
                   <= base + per_token * t.request.num_prompt_tokens for t in traces)
    loose_tbt = 10.0  # only the TTFT bound decides
    scaled = goodput(traces, 1.0, base, loose_tbt, 99.0, per_token)
    fixed = goodput(traces, 1.0, base, loose_tbt)
    assert scaled["num_met"] == expected and scaled["ttft_per_prompt_token_s"] == per_token
    assert fixed["num_met"] < scaled["num_met"] < len(traces)  # the bound matters both ways
