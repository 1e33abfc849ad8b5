"""Capacity search and rate sweeps: the largest request rate a deployment sustains within an SLO.

Capacity (Sarathi-Serve §5): the highest arrival rate at which P99 TBT stays within the SLO and
the queue stays stable. Sarathi-Serve calls a queue stable while the median scheduling delay
(arrival to first scheduled) is at most 2 s. The client does not see the scheduling delay, so
when a summary has no server-side `queueing_delay_s` the median TTFT stands in for it: TTFT
includes the delay, so the test is, if anything, stricter. Optional criteria: a TTFT SLO on the
median and a minimum goodput fraction (FastServe's P95 goodput: >= 0.95 meeting both SLOs).

The search assumes latency grows with the rate: it confirms the lower bound, doubles the upper
bound until it fails, then bisects until the bracket is within `rel_tolerance`. Each probe is
one call of `run_at_rate(rate) -> summary` (bench.metrics.summarize's dict, optionally with a
"goodput" entry from bench.metrics.goodput); the caller decides requests, seeds and repeats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from common.config import ConfigError

RunAtRate = Callable[[float], dict]


@dataclass(frozen=True)
class CapacityCriteria:
    tbt_p99_slo_s: float | None = None  # P99 TBT, pooled over all gaps, within this
    ttft_p50_slo_s: float | None = None  # median TTFT within this
    max_median_queueing_s: float = 2.0  # stable queue (Sarathi-Serve)
    min_goodput_fraction: float | None = None  # needs summary["goodput"]["fraction"]
    max_error_fraction: float = 0.0  # failed requests mean the load was not served

    def failures(self, summary: dict) -> list[str]:
        """Why the summary misses the criteria; empty when it meets them all."""
        found = []
        errors = summary["num_errors"] / max(1, summary["num_requests"])
        if errors > self.max_error_fraction:
            found.append(f"errors {errors:.2f}")
        tbt = summary["tbt_s"]["p99"]
        if self.tbt_p99_slo_s is not None and (tbt is None or tbt > self.tbt_p99_slo_s):
            found.append(f"p99 TBT {tbt}")
        ttft = summary["ttft_s"]["p50"]
        if self.ttft_p50_slo_s is not None and (ttft is None or ttft > self.ttft_p50_slo_s):
            found.append(f"p50 TTFT {ttft}")
        queue = (summary.get("queueing_delay_s") or summary["ttft_s"])["p50"]
        if queue is None or queue > self.max_median_queueing_s:
            found.append(f"median queueing {queue}")
        if self.min_goodput_fraction is not None:
            fraction = (summary.get("goodput") or {}).get("fraction")
            if fraction is None or fraction < self.min_goodput_fraction:
                found.append(f"goodput fraction {fraction}")
        return found


@dataclass
class Probe:
    rate: float
    ok: bool
    failures: list[str]
    summary: dict = field(repr=False)


@dataclass
class CapacityResult:
    capacity: float  # the highest rate that met the criteria; 0.0 if even `low` missed
    bracket: tuple[float, float | None]  # (last passing, first failing); None: none failed
    probes: list[Probe]


def _probe(run_at_rate: RunAtRate, criteria: CapacityCriteria, rate: float,
           probes: list[Probe]) -> bool:
    summary = run_at_rate(rate)
    failures = criteria.failures(summary)
    probes.append(Probe(rate, not failures, failures, summary))
    return not failures


def find_capacity(run_at_rate: RunAtRate, criteria: CapacityCriteria, low: float, high: float,
                  rel_tolerance: float = 0.05, max_probes: int = 16) -> CapacityResult:
    """The largest rate in [low, ...) meeting `criteria`, within `rel_tolerance` of the truth
    (relative to the passing end), using at most `max_probes` runs."""
    if not 0 < low < high or not 0 < rel_tolerance < 1 or max_probes < 2:
        raise ConfigError("need 0 < low < high, 0 < rel_tolerance < 1 and max_probes >= 2")
    probes: list[Probe] = []
    if not _probe(run_at_rate, criteria, low, probes):
        return CapacityResult(0.0, (0.0, low), probes)
    passing, failing = low, None
    while failing is None and len(probes) < max_probes:  # grow until a rate fails
        if _probe(run_at_rate, criteria, high, probes):
            passing, high = high, high * 2
        else:
            failing = high
    while failing is not None and failing - passing > rel_tolerance * passing \
            and len(probes) < max_probes:
        middle = (passing + failing) / 2
        if _probe(run_at_rate, criteria, middle, probes):
            passing = middle
        else:
            failing = middle
    return CapacityResult(passing, (passing, failing), probes)


def sweep(rates: list[float], run_at_rate: RunAtRate) -> list[tuple[float, dict]]:
    """One run per rate, in the given order: (rate, summary) pairs for rate-vs-latency plots."""
    if not rates or any(not r > 0 for r in rates):
        raise ConfigError(f"rates must be a non-empty list of positive numbers, got {rates}")
    return [(rate, run_at_rate(rate)) for rate in rates]


def geometric_rates(low: float, high: float, num: int) -> list[float]:
    """`num` rates from low to high, equally spaced on a log scale (a request-rate sweep)."""
    if not 0 < low < high or num < 2:
        raise ConfigError("need 0 < low < high and num >= 2")
    ratio = (high / low) ** (1 / (num - 1))
    return [low * ratio ** i for i in range(num)]
