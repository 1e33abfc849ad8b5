"""The instance process: one model load, one KV cache, the active role, and the loop that drives it.

Each turn of the loop:
  1. receive messages (waiting only while the role has nothing to run) and hand them to the role;
  2. `role.admit_compiled()`: constrained sequences whose grammar compiled join the scheduler;
     `role.poll()`: KV transfer completions, dispatch, leases and deadlines;
  3. every report interval: InstanceStats to the control plane (gateways or the store); when
     idle, the KV integrity check. Before the forward, so the report that stands while it runs
     counts what was just received;
  4. plan = role.schedule(); output = runner.execute(plan); role.update_from_output(plan, output);
  5. flush generated tokens to the gateways, one TokenBatch per gateway.

A FlipCommand makes the role drain (finish what it holds, take no new work that can go
elsewhere); once drained, the role object is replaced in place: same model, KV cache and block
tables, no reload. The FlipReport records the drain time and the switch time (drain excluded).

Roles (their contract: `common.engine.role`) and KV transfer backends are found by name in their
registries (`common.plugins.ROLES`, `common.transfer.BACKENDS`, filled from entry points), so this
module never imports their packages; roles see the backend only through `common.transfer`'s
interface.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from dataclasses import replace

import zmq

from common.block_pool import KVCacheManager
from common.config import InstanceConfig
from common.engine.control_link import make_link
from common.engine.forward_log import ForwardLog
from common.engine.metrics import InstanceMetrics, serve_http
from common.engine.model_runner import ModelRunner
from common.engine.role import Role, RoleContext
from common.messaging import Inbox, Outbox
from common.plugins import ROLES
from common.profile_record import served_identity
from common.protocol import (
    FlipCommand,
    FlipReport,
    GenerateRequest,
    InstanceStats,
    KVCacheEvents,
    Shutdown,
    TokenBatch,
)
from common.security import load_keys, stop_guard
from common.transfer import BACKENDS

log = logging.getLogger(__name__)

# Prefix-cache events are deltas; a full snapshot this often lets a gateway that started late,
# or missed an event (a store restart), converge.
KV_SNAPSHOT_INTERVAL_S = 10.0


class InstanceWorker:
    def __init__(self, config: InstanceConfig) -> None:
        backend_cls = BACKENDS.get(config.transfer.backend)
        if backend_cls.needs_shared_cache and not config.engine.cache.shared_memory:
            config = replace(config, engine=replace(config.engine, cache=replace(
                config.engine.cache, shared_memory=True)))
        self.config = config
        self.instance_id = config.instance_id or f"{config.role}-{uuid.uuid4().hex[:6]}"
        self.runner = ModelRunner(config.engine)
        self.identity = served_identity(self.runner)  # reported for matching profile records
        layout = self.runner.kv_layout
        self.zmq = zmq.Context()
        keys = load_keys(config.cluster_secret_file)
        self.inbox = Inbox(self.zmq, config.host, config.inbox_port, config.advertise_host, keys)
        self.outbox = Outbox(self.zmq, keys)
        self.transfer = backend_cls(self.runner.kv_cache, config.host, config.transfer)
        self.metrics = InstanceMetrics(self.instance_id)
        self.transfer.on_result = self.metrics.observe_transfer
        self.ctx = RoleContext(self.instance_id, config, self.runner,
                               KVCacheManager(layout.num_blocks, layout.block_size,
                                              config.engine.cache.prefix_caching),
                               self.transfer, self.outbox, self.inbox.address, self.metrics)
        self.http = (serve_http(self.metrics, config.host, max(config.metrics_port, 0))
                     if config.metrics_port else None)
        self._metrics_url = (f"http://{config.advertise_host or config.host}:"
                             f"{self.http.server_address[1]}" if self.http else "")
        # Every role imported up front, so that a flip only constructs an object.
        self.role_classes: dict[str, type[Role]] = ROLES.load_all()
        self.role = ROLES.get(config.role)(self.ctx)
        self.link = make_link(config, self.outbox)
        self.running = True
        self.busy_seconds = 0.0
        # Turns that ran a forward: how many, and their wall time from the inbox read on (the
        # forward plus the loop's own work around it: messages, scheduling, streaming, reports;
        # the read itself too unless the loop waited in it for work)
        self.num_forwards = 0
        self.forward_turn_seconds = 0.0
        self.forward_log = (ForwardLog(config.forward_log_dir, self.instance_id)
                            if config.forward_log_dir else None)
        self.computed_tokens = 0
        self.integrity_violations = 0
        self.requests_seen: dict[str, int] = {}  # gateway inbox -> GenerateRequests received
        self.flips: list[FlipReport] = []
        self._pending_flip: tuple[FlipCommand, float] | None = None  # (command, drain start)
        self._next_report = 0.0
        self._next_kv_snapshot = 0.0
        self.ctx.kv.pool.record_events = self.ctx.kv.prefix_caching

    def stop(self, *_args) -> None:
        self.running = False

    def run(self) -> None:
        self.transfer.start()
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        try:
            while self.running:
                self._turn()
        finally:
            self.close()

    def _turn(self) -> None:
        wait = 0.0 if self.role.has_work else self.role.wait_s
        started = time.perf_counter()
        messages = self.inbox.receive(wait) + self.link.receive()
        if wait:  # waiting for work is idle time; reading the inbox between forwards is not
            started = time.perf_counter()
        for message in messages:
            if isinstance(message, Shutdown):
                self.running = False
            elif isinstance(message, FlipCommand):
                self._start_flip(message)
            else:
                if isinstance(message, GenerateRequest):
                    self.requests_seen[message.reply_to] = \
                        self.requests_seen.get(message.reply_to, 0) + 1
                self.role.handle(message)
        self.role.admit_compiled()  # constrained sequences whose grammar is now ready
        self.role.poll()
        if self._pending_flip is not None and self.role.is_drained:
            self._finish_flip()
        if time.monotonic() >= self._next_report:
            # Before the forward, not after: the report then counts what was just received
            # (requests_seen included), and it stands for the whole forward.
            self._report()
        plan = self.role.schedule()
        if not plan.is_empty:
            output = self.runner.execute(plan)
            self.busy_seconds += output.forward_seconds
            self.computed_tokens += sum(c.num_tokens for c in plan.chunks)
            self.metrics.count("busy_seconds", output.forward_seconds)
            self.role.update_from_output(plan, output)
        self.metrics.last_turn = time.monotonic()
        self._flush_tokens()
        if not plan.is_empty:  # after the flush: sending the tokens is part of the turn's work
            turn = time.perf_counter() - started
            self.num_forwards += 1
            self.forward_turn_seconds += turn
            if self.forward_log is not None:
                self.forward_log.record(plan, output.forward_seconds, turn)

    def _start_flip(self, command: FlipCommand) -> None:
        if (command.target_role == self.role.name or self._pending_flip is not None
                or command.target_role not in self.role_classes):
            return
        self._pending_flip = (command, time.perf_counter())
        self.role.begin_drain()
        self._report()  # tell the gateways at once that this instance is draining

    def _finish_flip(self) -> None:
        command, drain_started = self._pending_flip
        self._pending_flip = None
        switch_started = time.perf_counter()
        old, num_migrated = self.role.name, self.role.num_migrated
        self.role.close()
        # Same runner, KV cache and block tables: only the role object changes.
        self.role = self.role_classes[command.target_role](self.ctx)
        switched = time.perf_counter()
        report = FlipReport(command.flip_id, self.instance_id, old, command.target_role,
                            switch_started - drain_started, switched - switch_started, time.time(),
                            num_migrated)
        self.flips.append(report)
        log.info("flipped %s -> %s: drain %.1f ms, switch %.3f ms", old, command.target_role,
                 report.drain_seconds * 1e3, report.switch_seconds * 1e3)
        self.link.notify(report)
        self._report()

    def _flush_tokens(self) -> None:
        pending = self.ctx.pending_tokens
        for address, updates in pending.items():
            self.outbox.send(address, TokenBatch(updates))
        pending.clear()

    def _report(self) -> None:
        self._next_report = time.monotonic() + self.config.report_interval_s
        if not self.role.has_work:
            self.check_integrity()
        stats = self.stats()
        self.metrics.update(stats.role, self.role.load(), stats.num_free_blocks,
                            stats.num_total_blocks,
                            (self.ctx.kv.stats, self.ctx.kv.pool.num_cached_blocks))
        self.link.report(stats)
        self._publish_kv_events()
        if self.forward_log is not None:
            self.forward_log.flush()

    def _publish_kv_events(self) -> None:
        """What the prefix cache stored and evicted since the last report, for cache-aware
        routing; now and then the whole set instead."""
        kv = self.ctx.kv
        if not kv.prefix_caching:
            return
        events = kv.pool.drain_events()
        if time.monotonic() >= self._next_kv_snapshot:
            self._next_kv_snapshot = time.monotonic() + KV_SNAPSHOT_INTERVAL_S
            self.link.notify(KVCacheEvents(self.instance_id, kv.block_size,
                                           kv.pool.cached_hashes(), snapshot=True))
        elif events.stored or events.removed:
            self.link.notify(KVCacheEvents(self.instance_id, kv.block_size, events.stored,
                                           events.removed))

    def check_integrity(self) -> bool:
        try:
            self.ctx.kv.check_integrity(self.role.live_seq_ids())
            return True
        except Exception as exc:  # a bookkeeping bug must be visible, not fatal
            self.integrity_violations += 1
            self.metrics.count("violations")
            log.error("KV integrity violation: %s", exc)
            return False

    def stats(self) -> InstanceStats:
        return InstanceStats(
            instance_id=self.instance_id, role=self.role.name, inbox=self.inbox.address,
            kv_endpoint=self.transfer.endpoint, model=self.runner.resolved.name,
            dtype=self.identity.dtype or "", num_threads=self.identity.threads or 0,
            max_model_len=self.runner.max_model_len, num_total_blocks=self.ctx.kv.num_blocks,
            num_free_blocks=self.ctx.kv.num_free_blocks, busy_seconds=self.busy_seconds,
            num_forwards=self.num_forwards, forward_turn_seconds=self.forward_turn_seconds,
            num_computed_tokens=self.computed_tokens,
            timestamp=time.time(), pid=os.getpid(), draining=self._pending_flip is not None,
            metrics_url=self._metrics_url, prefix_query_tokens=self.ctx.kv.stats.queries,
            prefix_hit_tokens=self.ctx.kv.stats.hits,
            num_cached_blocks=self.ctx.kv.pool.num_cached_blocks,
            requests_seen=dict(self.requests_seen), **self.role.load())

    def close(self) -> None:
        self.role.close()
        if self.http is not None:
            self.http.shutdown()
        self.link.close()
        self.transfer.close()
        if self.forward_log is not None:
            self.forward_log.close()
        self.inbox.close()
        self.outbox.close()
        stop_guard(self.zmq)
        self.zmq.term()
        self.runner.close()
