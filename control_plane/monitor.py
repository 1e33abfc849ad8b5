"""The cluster monitor: registry upkeep, leadership, decode-load broadcasts, flips.

Every tick (100 ms by default):
1. refresh the registry: from the store's heartbeats (Redis), or by expiring instances that stopped
   reporting to this gateway's inbox; instances that disappeared are declared dead and reported
   to the gateway, which recovers the requests they held;
2. take or renew leadership (one gateway of the replicas leads; without Redis, this one);
3. as leader: broadcast the ready decode instances' loads (and recently dead instances) to the
   prefill instances, record flip reports, and let the transition watcher start flips.

A broadcast is marked incomplete while instances the cluster was launched with have not reported
yet (`InstanceRegistry.expect`): a prefill instance places nothing from such a view.

Flips may also be ordered by hand (`POST /cluster/flip`). A flip marks the instance as flipping
here at once, so this gateway stops routing to it before the instance's next report.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable

from common.messaging import Outbox
from common.protocol import ClusterView, FlipCommand, FlipReport, InstanceStats, KVCacheEvents
from common.store import (
    CLUSTER_VIEW_CHANNEL,
    INSTANCE_EVENTS_CHANNEL,
    ControlStore,
    InProcessStore,
    StoreUnavailable,
)
from control_plane.cluster import InstanceRegistry
from control_plane.transition import TransitionWatcher, snapshot_now

log = logging.getLogger(__name__)
DEAD_MEMORY_S = 10.0  # how long dead instances are listed in broadcasts
LEADER_TTL_FACTOR = 5


class FlipError(ValueError):
    """A flip that cannot be done (unknown instance, same role, would empty a pool)."""


class ClusterMonitor:
    def __init__(self, registry: InstanceRegistry, store: ControlStore, outbox: Outbox,
                 gateway_id: str, interval_s: float, watcher: TransitionWatcher,
                 on_removed: Callable[[list[str]], None],
                 on_kv_events: Callable[[KVCacheEvents], None] = lambda events: None) -> None:
        self.registry, self.store, self.outbox = registry, store, outbox
        self.gateway_id, self.interval_s = gateway_id, interval_s
        self.watcher, self.on_removed = watcher, on_removed
        self.on_kv_events = on_kv_events
        self.uses_store = not isinstance(store, InProcessStore)
        registry.managed_by_store = self.uses_store
        self.is_leader = False
        self.recently_dead: dict[str, float] = {}
        self.recent_ttfts: deque[float] = deque(maxlen=50)
        self.timeline: deque[dict] = deque(maxlen=20_000)  # roles and queues over time
        self._instance_events = store.subscribe(INSTANCE_EVENTS_CHANNEL) if self.uses_store else None
        self.on_flip: Callable[[FlipReport], None] | None = None

    async def run(self) -> None:
        """Every tick: store I/O on a worker thread (a hung Redis must never stall the event
        loop; an in-process store never blocks and is read here), then the decisions here."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                fetched = (await asyncio.to_thread(self._fetch) if self.store.may_block
                           else self._fetch())
                self._apply(*fetched)
            except Exception:  # the monitor must outlive any one bad tick
                log.exception("cluster monitor tick failed")

    def tick(self) -> None:
        """One tick, synchronously (tests and single-threaded use)."""
        self._apply(*self._fetch())

    def _fetch(self) -> tuple:
        """(instance reports or None, store reachable, leader or None, instance events)."""
        reports, reachable, leader = None, True, None
        if self.uses_store:
            try:
                reports = self.store.instances()
            except StoreUnavailable:
                reachable = False
        try:
            leader = self.store.try_lead(self.gateway_id, LEADER_TTL_FACTOR * self.interval_s)
        except StoreUnavailable:
            pass  # keep the last answer until the store is back
        events = self._instance_events.poll(0.0) if self._instance_events is not None else []
        return reports, reachable, leader, events

    def _apply(self, reports, reachable: bool, leader: bool | None, events: list) -> None:
        for event in events:  # every replica routes, so every replica reads the cache events
            if isinstance(event, KVCacheEvents):
                self.on_kv_events(event)
        removed = self._refresh(reports, reachable)
        if removed:
            now = time.monotonic()
            self.recently_dead.update({i: now for i in removed})
            log.warning("instances declared dead: %s", ", ".join(removed))
            self.on_removed(removed)
        if leader is not None:
            self.is_leader = leader
        if self.is_leader:
            self._broadcast()
            for report in events:
                if isinstance(report, FlipReport):
                    self.on_flip_report(report)
            self._watch()
        self._record_timeline()

    # -- registry ----------------------------------------------------------------------------
    def _refresh(self, reports, reachable: bool) -> list[str]:
        if not self.uses_store:
            return self.registry.expire()
        if not reachable:
            self.registry.touch_all()
            return []
        return self.registry.sync(reports)

    def on_stats(self, stats: InstanceStats) -> None:
        """A report pushed to this gateway's inbox (no store)."""
        # a new decode instance, or the last one awaited at start-up: tell the prefills at once
        if self.registry.report(stats) and (stats.role == "decode" or self.registry.complete):
            self._broadcast()

    # -- broadcasts ----------------------------------------------------------------------------
    def _broadcast(self) -> None:
        now = time.monotonic()
        self.recently_dead = {i: t for i, t in self.recently_dead.items()
                              if now - t < DEAD_MEMORY_S}
        view = ClusterView(self.registry.decode_peers(), time.time(), list(self.recently_dead),
                           complete=self.registry.complete)
        if self.uses_store:
            self._in_background(self.store.publish, CLUSTER_VIEW_CHANNEL, view)
            return
        for state in self.registry.instances.values():  # decodes use the dead list too
            if self.registry.is_ready(state):
                self.outbox.send(state.stats.inbox, view)

    # -- flips ---------------------------------------------------------------------------------
    def flip(self, instance_id: str, target_role: str) -> str:
        state = self.registry.get(instance_id)
        if state is None:
            raise FlipError(f"no instance {instance_id!r}")
        if target_role not in ("prefill", "decode"):
            raise FlipError(f"cannot flip to {target_role!r}: roles are prefill and decode")
        if state.stats.role == target_role or state.draining:
            raise FlipError(f"{instance_id} is already {target_role} or flipping")
        if len(self.registry.routable(state.stats.role)) <= 1:
            raise FlipError(f"flipping {instance_id} would leave no {state.stats.role} instance")
        flip_id = uuid.uuid4().hex[:12]
        self.registry.mark_flipping(instance_id, target_role)
        self.outbox.send(state.stats.inbox, FlipCommand(flip_id, target_role))
        log.info("flip %s: %s %s -> %s", flip_id, instance_id, state.stats.role, target_role)
        return flip_id

    def on_flip_report(self, report: FlipReport) -> None:
        if self.on_flip is not None:
            self.on_flip(report)
        self._in_background(self.store.record_flip, {
            "flip_id": report.flip_id, "instance_id": report.instance_id,
            "from_role": report.from_role, "to_role": report.to_role,
            "drain_seconds": report.drain_seconds, "switch_seconds": report.switch_seconds,
            "timestamp": report.timestamp, "num_migrated": report.num_migrated})

    def _in_background(self, call, *args) -> None:
        """A store write that must not block the event loop (Redis may hang)."""
        def run():
            try:
                call(*args)
            except StoreUnavailable as exc:
                log.debug("store write skipped: %s", exc)
        try:
            asyncio.get_running_loop().run_in_executor(None, run)
        except RuntimeError:  # no event loop (synchronous use): write here
            run()

    def _watch(self) -> None:
        states = [s for s in self.registry.instances.values() if self.registry.is_ready(s)]
        in_flight = any(s.draining for s in states)
        routable = [s.stats for s in states if not s.draining]
        ttft = sum(self.recent_ttfts) / len(self.recent_ttfts) if self.recent_ttfts else None
        decision = self.watcher.step(snapshot_now(routable, ttft), in_flight)
        if decision is not None:
            log.info("transition watcher: %s -> %s (%s)", decision.instance_id,
                     decision.target_role, decision.reason)
            try:
                self.flip(decision.instance_id, decision.target_role)
            except FlipError as exc:
                log.info("watcher flip skipped: %s", exc)

    def _record_timeline(self) -> None:
        self.timeline.append({
            "time": time.time(),
            "instances": {s.stats.instance_id: {
                "role": s.stats.role, "draining": s.draining, "waiting": s.stats.num_waiting,
                "running": s.stats.num_running, "queued_tokens": s.stats.num_queued_tokens}
                for s in self.registry.instances.values()}})

    def close(self) -> None:
        if self._instance_events is not None:
            self._instance_events.close()
