"""The gateway's Prometheus metrics, served on the API port at GET /metrics.

  splitserve_requests_total{status}      ok, error, aborted, rejected (refused before running)
  splitserve_request_ttft_seconds        time to first token (histogram)
  splitserve_request_tbt_seconds         every gap between consecutive tokens (histogram)
  splitserve_request_jct_seconds         submit to last token (histogram)
  splitserve_prompt_tokens_total, splitserve_generation_tokens_total
  splitserve_instances{role}             ready instances per role
  splitserve_flips_total{direction}      e.g. prefill_to_decode
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TBT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
STATUSES = ("ok", "error", "aborted", "rejected")


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("splitserve_requests", "Requests by outcome", ["status"],
                                registry=r)
        for status in STATUSES:
            self.requests.labels(status=status)  # every status exported from the start
        self.ttft = Histogram("splitserve_request_ttft_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tbt = Histogram("splitserve_request_tbt_seconds", "Time between tokens",
                             buckets=TBT_BUCKETS, registry=r)
        self.jct = Histogram("splitserve_request_jct_seconds", "Job completion time",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens of requests run",
                                     registry=r)
        self.generation_tokens = Counter("splitserve_generation_tokens", "Tokens generated",
                                         registry=r)
        self.instances = Gauge("splitserve_instances", "Ready instances", ["role"], registry=r)
        self.flips = Counter("splitserve_flips", "Completed flips", ["direction"], registry=r)

    def finished(self, status: str, num_prompt: int, num_output: int, jct_s: float | None) -> None:
        self.requests.labels(status=status).inc()
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_output)
        if jct_s is not None:
            self.jct.observe(jct_s)

    def exposition(self, instances_by_role: dict[str, int]) -> bytes:
        for role in ("prefill", "decode", "coupled"):
            self.instances.labels(role=role).set(instances_by_role.get(role, 0))
        return generate_latest(self.registry)
