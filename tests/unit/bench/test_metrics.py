"""bench.metrics: golden numbers on hand-built records, errors, and empty inputs."""

from __future__ import annotations

import pytest

from bench.client import RequestRecord
from bench.metrics import run_duration, stats, summarize


def _records() -> list[RequestRecord]:
    return [
        # 3 tokens: TPOT (0.5 - 0.1) / 2 = 0.2; gaps 0.1, 0.2
        RequestRecord(index=0, send_time=0.0, ttft=0.1, token_times=[0.1, 0.2, 0.4], jct=0.5,
                      prompt_tokens=10, output_tokens=3, finish_reason="length"),
        # 2 tokens: TPOT (0.7 - 0.3) / 1 = 0.4; gap 0.1
        RequestRecord(index=1, send_time=1.0, ttft=0.3, token_times=[1.3, 1.4], jct=0.7,
                      prompt_tokens=20, output_tokens=2, finish_reason="stop"),
        # 1 token: no TPOT, no gap
        RequestRecord(index=2, send_time=2.0, ttft=0.2, token_times=[2.2], jct=0.2,
                      prompt_tokens=5, output_tokens=1, finish_reason="length"),
        # failed: excluded from every latency and token count
        RequestRecord(index=3, send_time=2.5, ttft=0.05, token_times=[2.55, 2.56], jct=0.1,
                      prompt_tokens=100, output_tokens=50, error="HTTP 500: boom",
                      http_status=500),
    ]


def test_latency_distributions():
    summary = summarize(_records(), duration_s=2.0)
    approx = pytest.approx
    assert summary["ttft_s"] == approx({"mean": 0.2, "p50": 0.2, "p99": 0.298})
    assert summary["tpot_s"] == approx({"mean": 0.3, "p50": 0.3, "p99": 0.398})
    assert summary["jct_s"] == approx({"mean": 1.4 / 3, "p50": 0.5, "p99": 0.696})
    assert summary["tbt_s"] == approx({"p50": 0.1, "p99": 0.198})


def test_counts_tokens_and_throughput():
    summary = summarize(_records(), duration_s=2.0)
    assert (summary["num_requests"], summary["num_ok"], summary["num_errors"]) == (4, 3, 1)
    assert summary["errors"] == {"HTTP 500: boom": 1}
    assert summary["total_prompt_tokens"] == 35
    assert summary["total_output_tokens"] == 6
    assert summary["throughput"] == pytest.approx(
        {"requests_per_s": 1.5, "output_tokens_per_s": 3.0, "total_tokens_per_s": 20.5})


def test_run_duration_spans_first_send_to_last_completion():
    assert run_duration(_records()) == pytest.approx(2.6)
    assert run_duration([]) == 0.0


def test_empty_input_gives_none_values():
    summary = summarize([], duration_s=0.0)
    assert (summary["num_requests"], summary["num_ok"], summary["num_errors"]) == (0, 0, 0)
    for key in ("ttft_s", "tpot_s", "jct_s"):
        assert summary[key] == {"mean": None, "p50": None, "p99": None}
    assert summary["tbt_s"] == {"p50": None, "p99": None}
    assert set(summary["throughput"].values()) == {None}


def test_only_failures_give_none_latencies():
    failed = [RequestRecord(index=0, send_time=0.0, jct=0.1, error="ConnectError: refused")]
    summary = summarize(failed, duration_s=run_duration(failed))
    assert summary["num_errors"] == 1
    assert summary["ttft_s"]["p50"] is None
    assert summary["throughput"]["requests_per_s"] == 0.0


def test_stats_of_one_value():
    assert stats([0.25]) == {"mean": 0.25, "p50": 0.25, "p99": 0.25}
