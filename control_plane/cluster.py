"""What the gateway knows about the instances: the registry, readiness, load, and choices.

Instances register with their first InstanceStats and report every 100 ms; one that has not
reported for `instance_timeout_s` is not ready. The global scheduler's choice of a prefill
instance is least loaded: prompt tokens it reported queued plus those this gateway sent it that
the report does not count yet (so a burst does not all land on the instance that looked idle a
moment ago). Each report echoes how many requests the instance has received from each gateway
(`requests_seen`), so a send stays counted until a report that has seen it: not cleared by a
report made before it arrived, nor by the store handing back the same report again.

A cluster started by `splitserve up` names the instances it launched (`expect`): until each has
reported once the cluster is not serving and the monitor's views say they are incomplete, so no
request is placed on the first decode instances to come up while the others are loading.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from common.protocol import InstanceStats, PeerInfo


RATE_SMOOTHING = 0.2  # weight of the newest report in tokens_per_busy_second


def decode_peer(stats: InstanceStats) -> PeerInfo:
    """A decode instance as the dispatchers see it: every sequence offered there and not
    finished counts as placed (waiting, being read, decoding; heavy or light by prediction),
    and the blocks its waiting offers will take on admission are not free."""
    heavy, light = stats.num_incoming_heavy, stats.num_incoming_light
    return PeerInfo(stats.instance_id, stats.inbox, stats.kv_endpoint,
                    num_free_blocks=max(stats.num_free_blocks - stats.num_reserved_blocks, 0),
                    num_total_blocks=stats.num_total_blocks,
                    num_running=stats.num_running + heavy + light,
                    num_waiting=stats.num_waiting,
                    num_heavy=stats.num_heavy_decodes + heavy,
                    num_light=stats.num_light_decodes + light,
                    offers_seen=dict(stats.offers_seen), report_time=stats.timestamp)


def is_repeat(held: InstanceStats, stats: InstanceStats) -> bool:
    """The report held, seen again (the same timestamp and role). Not "older than held": a
    clock stepped back must not silence an instance. A report without a timestamp is new."""
    return bool(stats.timestamp) and stats.timestamp == held.timestamp and \
        stats.role == held.role


@dataclass
class InstanceState:
    stats: InstanceStats
    last_seen: float  # time.monotonic()
    # Requests this gateway sent that the instance's reports have not counted yet, and their
    # prompt tokens (what routing and admission add to the reported queue).
    sent_tokens_since_report: int = 0
    sent_requests_since_report: int = 0
    # With an echo (`InstanceRegistry.address`): the number of the last request sent, on the
    # instance's count of requests from this gateway, and (number, tokens) of those not counted.
    num_sent: int = 0
    unacknowledged: deque = field(default_factory=deque)
    first_seen: float = field(default_factory=time.monotonic)
    flip_target: str = ""  # a flip to this role was ordered here and has not completed yet
    # Tokens computed per second of forward time, smoothed over reports (0 = not known yet): how
    # fast this instance works through its queue under whatever else shares its cores.
    tokens_per_busy_second: float = 0.0

    def absorb_rate(self, previous: InstanceStats) -> None:
        busy = self.stats.busy_seconds - previous.busy_seconds
        tokens = self.stats.num_computed_tokens - previous.num_computed_tokens
        if busy <= 0 or tokens <= 0:
            return  # a repeated report (long forward) or an idle interval: nothing learned
        rate = tokens / busy
        old = self.tokens_per_busy_second
        self.tokens_per_busy_second = rate if old == 0 else (1 - RATE_SMOOTHING) * old + \
            RATE_SMOOTHING * rate

    @property
    def queued_seconds(self) -> float | None:
        """Estimated seconds of forward work in this instance's queue (None: rate unknown)."""
        if self.tokens_per_busy_second <= 0:
            return None
        queued = self.stats.num_queued_tokens + self.sent_tokens_since_report
        return queued / self.tokens_per_busy_second

    @property
    def draining(self) -> bool:
        return self.stats.draining or bool(self.flip_target)


class InstanceRegistry:
    def __init__(self, instance_timeout_s: float) -> None:
        self.instance_timeout_s = instance_timeout_s
        self.instances: dict[str, InstanceState] = {}
        self.store_stale = False  # the store is unreachable: loads are a frozen last view
        # With a store, membership is the store's (sync); readiness does not also age here,
        # so a slow store cannot make every instance look dead.
        self.managed_by_store = False
        self.awaiting: set[str] = set()  # launched with the cluster, not reported yet
        # This gateway's inbox: instances echo how many requests they received from each
        # (InstanceStats.requests_seen). "" = no echo: a new report clears the sent counts.
        self.address = ""
        # Instances that take new work, by role (`_routable_by_role`); None: rebuild
        self._by_role: dict[str, list[InstanceState]] | None = None
        self._by_role_size = 0

    def expect(self, instance_ids) -> None:
        """The cluster was launched with these instances: it is complete once each reported."""
        self.awaiting = set(instance_ids) - set(self.instances)

    @property
    def complete(self) -> bool:
        return not self.awaiting

    def report(self, stats: InstanceStats) -> bool:
        """Record a load report; True when the instance is new (or changed role)."""
        state = self.instances.get(stats.instance_id)
        is_new = state is None or state.stats.role != stats.role
        self.awaiting.discard(stats.instance_id)
        if state is None:
            now = time.monotonic()
            self.instances[stats.instance_id] = InstanceState(
                stats, now, num_sent=self._echo(stats), first_seen=now)
            self._by_role = None
        elif is_repeat(state.stats, stats):
            # During a long forward the instance's heartbeat resends its last report, and the
            # store hands it back on every sync: it says nothing about what was sent since.
            state.last_seen = time.monotonic()
            return False
        else:
            if is_new or stats.draining != state.stats.draining or state.flip_target:
                self._by_role = None  # its role or whether it takes work may change
            previous, state.stats, state.last_seen = state.stats, stats, time.monotonic()
            self._acknowledge(state, previous)
            if is_new:
                state.tokens_per_busy_second = 0.0  # another role: another kind of work
            else:
                state.absorb_rate(previous)
            if state.flip_target == stats.role:
                state.flip_target = ""  # the flip completed
        return is_new

    def _echo(self, stats: InstanceStats) -> int:
        return stats.requests_seen.get(self.address, 0) if self.address else 0

    def _acknowledge(self, state: InstanceState, previous: InstanceStats) -> None:
        """Drop from the sent counts what the new report counts itself. With an echo, the
        requests up to the number the instance has received from this gateway: one sent after
        the report was made, or still in the instance's inbox, stays counted. Without one (no
        address: tests, or a gateway that cannot be named), everything sent so far."""
        seen = self._echo(state.stats)
        if not self.address or state.stats.pid != previous.pid:
            state.unacknowledged.clear()  # no echo, or a new process counting from 0
            state.num_sent = seen
        while state.unacknowledged and state.unacknowledged[0][0] <= seen:
            state.unacknowledged.popleft()
        state.sent_requests_since_report = len(state.unacknowledged)
        state.sent_tokens_since_report = sum(tokens for _, tokens in state.unacknowledged)

    def sync(self, reports: list[InstanceStats]) -> list[str]:
        """Merge the store's view; returns the ids declared dead.

        An instance missing from the store is declared dead only once it has been missing for
        the instance timeout: right after the store restarts empty, live instances need one
        report interval to register again, and must not be taken for dead meanwhile."""
        self.store_stale = False
        present = {s.instance_id for s in reports}
        for stats in reports:
            self.report(stats)
        now = time.monotonic()
        removed = [i for i, s in self.instances.items()
                   if i not in present and now - s.last_seen > self.instance_timeout_s]
        self._remove(removed)
        return removed

    def expire(self) -> list[str]:
        """Remove instances silent for longer than the timeout; returns their ids."""
        now = time.monotonic()
        removed = [i for i, s in self.instances.items() if not self.is_ready(s, now)]
        self._remove(removed)
        return removed

    def _remove(self, instance_ids: list[str]) -> None:
        for instance_id in instance_ids:
            del self.instances[instance_id]
        if instance_ids:
            self._by_role = None

    def touch_all(self) -> None:
        """The store is unreachable: keep the last view alive rather than declare all dead."""
        self.store_stale = True
        now = time.monotonic()
        for state in self.instances.values():
            state.last_seen = now

    def mark_flipping(self, instance_id: str, target_role: str) -> None:
        state = self.instances.get(instance_id)
        if state is not None:
            state.flip_target = target_role
            self._by_role = None

    def is_ready(self, state: InstanceState, now: float | None = None) -> bool:
        if self.managed_by_store:
            return True
        now = time.monotonic() if now is None else now
        return now - state.last_seen <= self.instance_timeout_s

    def ready(self, role: str) -> list[InstanceState]:
        now = time.monotonic()
        return [s for s in self.instances.values()
                if s.stats.role == role and self.is_ready(s, now)]

    def routable(self, role: str) -> list[InstanceState]:
        """Ready instances of `role` that take new work (not draining for a flip)."""
        states = self._routable_by_role().get(role, ())
        if self.managed_by_store:
            return list(states)
        now = time.monotonic()
        return [s for s in states if self.is_ready(s, now)]

    def _routable_by_role(self) -> dict[str, list[InstanceState]]:
        """Instances not draining, by role, in registration order. Every request's routing
        reads these several times, so they are rebuilt only when an instance joins, leaves,
        changes role or starts or stops draining, not scanned from every instance each time
        (the size check also catches an instance deleted from `instances` directly)."""
        by_role = self._by_role
        if by_role is None or self._by_role_size != len(self.instances):
            by_role = {}
            for state in self.instances.values():
                if not state.draining:
                    by_role.setdefault(state.stats.role, []).append(state)
            self._by_role, self._by_role_size = by_role, len(self.instances)
        return by_role

    def is_serving(self) -> bool:
        """A prefill and a decode instance, or a coupled one (serves requests end to end); and
        every instance the cluster was launched with has reported."""
        disaggregated = bool(self.routable("prefill")) and bool(self.routable("decode"))
        return self.complete and (disaggregated or bool(self.routable("coupled")))

    def entry_points(self) -> list[InstanceState]:
        """Where new requests go: prefill instances with a decode pool, and coupled ones."""
        entries = self.routable("coupled")
        if self.routable("decode"):
            entries += self.routable("prefill")
        return entries

    def least_loaded_prefill(self, exclude: set[str] = frozenset()) -> InstanceState | None:
        candidates = [s for s in self.entry_points() if s.stats.instance_id not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda s: (
            s.stats.num_queued_tokens + s.sent_tokens_since_report,
            s.stats.num_waiting + s.sent_requests_since_report, s.stats.instance_id))

    def note_sent(self, state: InstanceState, num_tokens: int) -> None:
        state.sent_tokens_since_report += num_tokens
        state.sent_requests_since_report += 1
        state.num_sent += 1
        if self.address:
            state.unacknowledged.append((state.num_sent, num_tokens))

    def decode_peers(self) -> list[PeerInfo]:
        return [decode_peer(s.stats) for s in self.routable("decode")]

    def get(self, instance_id: str) -> InstanceState | None:
        return self.instances.get(instance_id)

    def describe(self) -> list[dict]:
        now = time.monotonic()
        rows = []
        for state in sorted(self.instances.values(), key=lambda s: s.stats.instance_id):
            s = state.stats
            rows.append({
                "instance_id": s.instance_id, "role": s.role, "ready": self.is_ready(state, now),
                "draining": state.draining, "flip_target": state.flip_target or None,
                "decodes": {"heavy": s.num_heavy_decodes, "light": s.num_light_decodes,
                            "finished_heavy": s.num_finished_heavy,
                            "finished_light": s.num_finished_light,
                            "preemptions": s.num_preemptions,
                            "first_admit_time": s.first_admit_time,
                            "last_finish_time": s.last_finish_time},
                "inbox": s.inbox, "kv_endpoint": s.kv_endpoint, "pid": s.pid, "model": s.model,
                "dtype": s.dtype or None, "threads": s.num_threads or None,
                "metrics_url": s.metrics_url or None,
                "queue": {"waiting": s.num_waiting, "running": s.num_running,
                          "transferring": s.num_transferring,
                          "queued_tokens": s.num_queued_tokens},
                "kv_blocks": {"total": s.num_total_blocks, "free": s.num_free_blocks,
                              "used": s.num_total_blocks - s.num_free_blocks,
                              "cached": s.num_cached_blocks},
                "prefix_cache": {"query_tokens": s.prefix_query_tokens,
                                 "hit_tokens": s.prefix_hit_tokens,
                                 "hit_rate": round(s.prefix_hit_tokens
                                                   / max(s.prefix_query_tokens, 1), 4),
                                 "blocks_read": s.kv_blocks_read,
                                 "blocks_skipped": s.kv_blocks_skipped,
                                 "local_prefills": s.num_local_prefills},
                "policy": dict(s.policy_counters),
                "busy_seconds": round(s.busy_seconds, 3), "num_forwards": s.num_forwards,
                "forward_turn_seconds": round(s.forward_turn_seconds, 3),
                "uptime_s": round(now - state.first_seen, 3),  # since its first report here
                "seconds_since_report": round(now - state.last_seen, 3)})
        return rows
