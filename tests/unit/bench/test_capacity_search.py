"""Capacity search against a synthetic latency-vs-rate model (an M/M/1-like queue)."""

from __future__ import annotations

import pytest

from bench.capacity import CapacityCriteria, find_capacity, geometric_rates, sweep
from common.config import ConfigError

SERVICE_RATE = 10.0  # requests/s the synthetic server completes


def synthetic(rate: float, errors: int = 0) -> dict:
    """What summarize() would report at `rate`: queueing explodes near the service rate, TBT
    grows with the load (more prefills interleaved with decodes)."""
    queue = 0.05 + 1 / (SERVICE_RATE - rate) if rate < SERVICE_RATE else 100.0
    return {"num_requests": 100, "num_errors": errors,
            "ttft_s": {"mean": queue, "p50": queue, "p99": 2 * queue},
            "tbt_s": {"p50": 0.02, "p99": 0.02 * (1 + 4 * rate / SERVICE_RATE)},
            "queueing_delay_s": None}


class Counting:
    def __init__(self, model=synthetic):
        self.model, self.rates = model, []

    def __call__(self, rate: float) -> dict:
        self.rates.append(rate)
        return self.model(rate)


def test_capacity_limited_by_the_tbt_slo():
    run = Counting()
    # p99 TBT = 0.02 (1 + 0.4 rate) <= 0.06  <=>  rate <= 5
    result = find_capacity(run, CapacityCriteria(tbt_p99_slo_s=0.06), low=1.0, high=2.0)
    assert 5.0 * 0.95 <= result.capacity <= 5.0
    passing, failing = result.bracket
    assert failing > 5.0 and (failing - passing) <= 0.05 * passing
    assert run.rates[:4] == [1.0, 2.0, 4.0, 8.0]  # confirm low, then double until a failure
    assert [p.ok for p in result.probes][:4] == [True, True, True, False]
    assert "p99 TBT" in result.probes[3].failures[0]


def test_capacity_limited_by_queue_stability():
    # median queueing (TTFT stands in) = 0.05 + 1 / (10 - rate) <= 2  <=>  rate <= 9.487
    result = find_capacity(Counting(), CapacityCriteria(), low=1.0, high=4.0,
                           rel_tolerance=0.01)
    assert 9.487 * 0.99 <= result.capacity <= 9.487


def test_server_side_queueing_delay_is_preferred_to_ttft():
    def model(rate):
        summary = synthetic(rate)
        summary["queueing_delay_s"] = {"mean": 0.1, "p50": 0.1, "p99": 0.1}  # always stable
        summary["ttft_s"] = {"mean": 50.0, "p50": 50.0, "p99": 50.0}
        return summary

    result = find_capacity(Counting(model), CapacityCriteria(tbt_p99_slo_s=0.06), 1.0, 2.0)
    assert 4.75 <= result.capacity <= 5.0


def test_no_capacity_when_the_lowest_rate_fails():
    result = find_capacity(Counting(), CapacityCriteria(tbt_p99_slo_s=0.01), 1.0, 2.0)
    assert result.capacity == 0.0 and len(result.probes) == 1 and result.bracket == (0.0, 1.0)


def test_errors_and_goodput_criteria():
    failing = CapacityCriteria(max_error_fraction=0.0).failures(synthetic(1.0, errors=3))
    assert failing == ["errors 0.03"]
    criteria = CapacityCriteria(min_goodput_fraction=0.95)
    assert criteria.failures(synthetic(1.0)) == ["goodput fraction None"]
    assert criteria.failures({**synthetic(1.0), "goodput": {"fraction": 0.97}}) == []


def test_probe_budget_is_respected():
    run = Counting()
    result = find_capacity(run, CapacityCriteria(tbt_p99_slo_s=0.06), 1.0, 2.0,
                           rel_tolerance=1e-6, max_probes=7)
    assert len(run.rates) == 7 and 4.0 <= result.capacity <= 5.0


def test_a_rate_that_never_fails_is_reported_without_a_failing_end():
    result = find_capacity(Counting(lambda rate: synthetic(0.0)), CapacityCriteria(), 1.0, 2.0,
                           max_probes=4)
    assert result.bracket == (8.0, None) and result.capacity == 8.0


def test_sweep_and_rates():
    rates = geometric_rates(0.5, 8.0, 5)
    assert rates == pytest.approx([0.5, 1.0, 2.0, 4.0, 8.0])
    points = sweep(rates, synthetic)
    assert [r for r, _ in points] == rates
    tbts = [s["tbt_s"]["p99"] for _, s in points]
    assert tbts == sorted(tbts)
    with pytest.raises(ConfigError):
        sweep([], synthetic)
    with pytest.raises(ConfigError):
        find_capacity(synthetic, CapacityCriteria(), low=2.0, high=1.0)
