"""An instance's Prometheus metrics and its small HTTP endpoint (/health, /ready, /metrics).

Series (labels `instance_id` and `role` on all):
  splitserve_queue_length{stage}            prefill_waiting, prefill_running, transferring,
                                            decode_waiting, decode_running
  splitserve_kv_blocks{state}               free, used, cached (free or used, shareable)
  splitserve_prefix_cache_query_tokens_total, splitserve_prefix_cache_hit_tokens_total
                                            hit rate = rate(hit) / rate(query)
  splitserve_kv_transfer_blocks_total{kind} read (from a prefill instance), skipped (cached here)
  splitserve_kv_transfer_bytes_total, splitserve_kv_transfer_seconds (histogram),
  splitserve_kv_transfer_failures_total, splitserve_kv_leases_expired_total,
  splitserve_length_predictions_total{outcome}   exact, within_one, miss
  splitserve_kv_integrity_violations_total, splitserve_busy_seconds_total

/health answers 200 while the instance loop keeps turning; /ready once the model is loaded and the
instance has reported to the control plane.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

STAGES = ("prefill_waiting", "prefill_running", "transferring", "decode_waiting",
          "decode_running")
LOOP_STALL_S = 10.0


def stages_for(role: str, load: dict) -> dict[str, int]:
    """Map a role's load report onto the pipeline stages."""
    stages = dict.fromkeys(STAGES, 0)
    stages["transferring"] = load.get("num_transferring", 0)
    if role == "decode":
        stages["decode_waiting"] = load["num_waiting"]
        stages["decode_running"] = load["num_running"]
    elif role == "prefill":
        stages["prefill_waiting"] = load["num_waiting"]
        stages["prefill_running"] = load["num_running"]
    else:  # coupled: waiting prompts, running sequences
        stages["prefill_waiting"] = load["num_waiting"]
        stages["decode_running"] = load["num_running"]
    return stages


class InstanceMetrics:
    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.registry = CollectorRegistry()
        labels = ["instance_id", "role"]
        r = self.registry
        self.queue = Gauge("splitserve_queue_length", "Sequences per pipeline stage",
                           labels + ["stage"], registry=r)
        self.blocks = Gauge("splitserve_kv_blocks", "KV blocks by state", labels + ["state"],
                            registry=r)
        self.transfer_bytes = Counter("splitserve_kv_transfer_bytes", "KV bytes moved",
                                      labels, registry=r)
        self.transfer_seconds = Histogram(
            "splitserve_kv_transfer_seconds", "Duration of one KV transfer job", labels,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30), registry=r)
        self.transfer_failures = Counter("splitserve_kv_transfer_failures",
                                         "Failed KV transfer jobs", labels, registry=r)
        self.leases_expired = Counter("splitserve_kv_leases_expired", "KV leases that expired",
                                      labels, registry=r)
        self.predictions = Counter("splitserve_length_predictions",
                                   "Length predictions against realized lengths",
                                   labels + ["outcome"], registry=r)
        self.violations = Counter("splitserve_kv_integrity_violations",
                                  "KV integrity check failures", labels, registry=r)
        self.busy = Counter("splitserve_busy_seconds", "Wall time in forwards", labels,
                            registry=r)
        self.prefix_queries = Counter("splitserve_prefix_cache_query_tokens",
                                      "Prompt tokens looked up in the prefix cache", labels,
                                      registry=r)
        self.prefix_hits = Counter("splitserve_prefix_cache_hit_tokens",
                                   "Prompt tokens found in the prefix cache", labels, registry=r)
        self.transfer_blocks = Counter("splitserve_kv_transfer_blocks",
                                       "KV blocks of received sequences, read or found cached",
                                       labels + ["kind"], registry=r)
        self._prefix_seen = (0, 0)
        self.role = "?"
        self.last_turn = time.monotonic()
        self.reported = False

    def _labels(self, **extra) -> dict:
        return {"instance_id": self.instance_id, "role": self.role, **extra}

    def set_role(self, role: str) -> None:
        if role != self.role:
            for metric in (self.queue, self.blocks):
                metric.clear()  # series of the old role must not linger
            self.role = role
            for counter in (self.transfer_bytes, self.transfer_failures, self.leases_expired,
                            self.violations, self.busy, self.prefix_queries, self.prefix_hits):
                counter.labels(**self._labels())  # exported as 0 before the first event

    def update(self, role: str, load: dict, free_blocks: int, total_blocks: int,
               prefix=None) -> None:
        """`prefix`: the KV manager's cumulative PrefixStats and cached block count."""
        self.set_role(role)
        for stage, value in stages_for(role, load).items():
            self.queue.labels(**self._labels(stage=stage)).set(value)
        self.blocks.labels(**self._labels(state="free")).set(free_blocks)
        self.blocks.labels(**self._labels(state="used")).set(total_blocks - free_blocks)
        if prefix is not None:
            stats, num_cached = prefix
            queries, hits = self._prefix_seen
            self.prefix_queries.labels(**self._labels()).inc(stats.queries - queries)
            self.prefix_hits.labels(**self._labels()).inc(stats.hits - hits)
            self._prefix_seen = (stats.queries, stats.hits)
            self.blocks.labels(**self._labels(state="cached")).set(num_cached)
        self.reported = True

    def observe_transfer(self, result) -> None:
        if result.ok:
            self.transfer_bytes.labels(**self._labels()).inc(result.num_bytes)
            self.transfer_seconds.labels(**self._labels()).observe(result.seconds)
        else:
            self.transfer_failures.labels(**self._labels()).inc()

    def count(self, name: str, amount: float = 1.0, **extra) -> None:
        metric = {"leases_expired": self.leases_expired, "violations": self.violations,
                  "busy_seconds": self.busy, "predictions": self.predictions,
                  "transfer_blocks": self.transfer_blocks}[name]
        metric.labels(**self._labels(**extra)).inc(amount)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def serve_http(metrics: InstanceMetrics, host: str, port: int) -> ThreadingHTTPServer:
    """Start /health, /ready and /metrics on a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/metrics":
                self._reply(200, metrics.exposition(), CONTENT_TYPE_LATEST)
            elif self.path == "/health":
                alive = time.monotonic() - metrics.last_turn < LOOP_STALL_S
                self._reply(200 if alive else 503, b"ok" if alive else b"loop stalled")
            elif self.path == "/ready":
                self._reply(200 if metrics.reported else 503,
                            b"ready" if metrics.reported else b"starting")
            else:
                self._reply(404, b"not found")

        def _reply(self, status: int, body: bytes, kind: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args):
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
