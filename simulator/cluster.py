"""The simulated cluster: the gateway's routing, the monitor's views and flips, KV links, traces.

- Gateway (control_plane/gateway.py `_send_attempt`): each arrival is routed by the REAL
  `Router` (route policy, conditional disaggregation) over a REAL `InstanceRegistry`, and
  `note_sent` counts it until the target's next report. A request an instance refuses (it
  flipped meanwhile), or a draining decode instance hands back, is recovered as
  `Gateway._recover` does: routed again without the attempt's prefill and decode instances
  (anywhere when only they can take it), at most `max_recoveries` times.
- Monitor (control_plane/monitor.py, one tick per `broadcast_interval_s`): every instance
  reports (`InstanceStats`, as the worker builds them), the ready decode instances go to the
  prefill instances as a `ClusterView` (PeerInfo by the real `decode_peer`), and the REAL
  `TransitionWatcher` decides flips from a `PoolSnapshot` stamped with simulated time. The
  registry's readiness is not aged by the wall clock (`managed_by_store`): no instance dies here.
- KV links: one per receiving instance, first come first served: a transfer holds the link for
  bytes / bandwidth and lands `latency_s` later.
- Traces: per request, as the gateway streams it: arrival, each token's time, the end.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from dataclasses import dataclass, field

from common.block_pool import KVCacheManager
from common.config import ConfigError, GatewayConfig, InstanceConfig
from common.protocol import ClusterView, KVTransferOffer
from common.sampling_params import SamplingParams
from common.sequence import Sequence
from control_plane.cluster import InstanceRegistry
from control_plane.transition import FlipDecision, PoolSnapshot
from simulator import policies
from simulator.costs import CostModel, Link, link_named
from simulator.cores import SharedCores
from simulator.engine import EventLoop
from simulator.instances import GATEWAY, SimInstance
from simulator.workload import EOS_TOKEN, SimRequest


@dataclass(frozen=True)
class Layout:
    """A cluster: how many instances of each role, and the configs `splitserve up` would hand
    them (one InstanceConfig shared by all, the role set per instance) and its gateway."""

    num_prefill: int = 1
    num_decode: int = 1
    num_coupled: int = 0
    instance: InstanceConfig = field(default_factory=InstanceConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    # KV link preset (simulator.costs.LINK_PRESETS); None: the instance config's transfer
    # emulation when it sets a bandwidth (what an emulated real run paces to), else the cost
    # model's default link
    link: str | None = None
    message_latency_s: float = 0.0  # control messages (requests, offers, acks, views)
    # The serving stack's own latency per request beyond the forwards (HTTP, tokenization,
    # routing, the first token's way back: simulator.request_path), charged on its way in
    request_latency_s: float = 0.0
    flip_switch_s: float = 0.01  # a drained instance's role switch (no model reload)
    # An instance loop's own work per forward (messages, scheduling, streaming, reports), after
    # each forward and before its tokens count; 0: the loop costs nothing beside the forwards
    turn_overhead_s: float = 0.0
    # A forward that starts when the instance had nothing to do takes this much longer (its
    # threads and caches wake up: measured from forward logs, simulator.calibrate); 0: none
    wake_s: float = 0.0
    # ... for a first forward that carries a prompt chunk (a prefill instance's chunk after a
    # wait: its excess was 81-109 ms where decode steps' was 5-21 ms on 2026-12-02's Zen 1);
    # None: wake_s
    wake_prompt_s: float | None = None
    # The KV hand-off's own time beyond the link (the offer, the admission, the read served
    # beside the prefill instance's forwards, the sequence joining the decode loop:
    # simulator.request_path.handoff), added to every transfer; 0: the link alone
    handoff_s: float = 0.0
    # ... and its time per token of KV read beyond the link's bytes (a real read gathers,
    # sends, receives and scatters them: measured with handoff_s); it holds the receiving
    # instance's link as its bytes do, since a real decode instance reads one job at a time
    handoff_per_token_s: float = 0.0
    drain_limit_s: float = 3600.0  # after the last arrival, stop and count the rest unfinished
    # Step a decode instance's steady batch without planning it (simulator/steady.py): the same
    # result, several times faster; False plans every forward with the scheduler.
    steady_decode: bool = True
    leap_steps: int = 64  # at most this many steady forwards planned at once (1: one at a time)
    # Keep each forward's shape and seconds (SimInstance.forwards), as a real instance's forward
    # log does (simulator.forward_check compares the two)
    record_forwards: bool = False
    # The instances share this many cores, `core_threads` threads each (simulator/cores.py):
    # a forward slows while more threads want a core than there are (a 1P2D cluster of 1-thread
    # instances on a 2-core machine); None: each instance has its own hardware. Decode steps are
    # then planned one at a time (no steady leaps: a leap's times assume its core to itself)
    shared_cores: int | None = None
    core_threads: int = 1

    def __post_init__(self) -> None:
        if min(self.num_prefill, self.num_decode, self.num_coupled) < 0:
            raise ConfigError("instance counts must be >= 0")
        if min(self.turn_overhead_s, self.request_latency_s, self.message_latency_s,
               self.wake_s, self.wake_prompt_s or 0.0, self.handoff_s,
               self.handoff_per_token_s) < 0:
            raise ConfigError("the turn overhead, the wake-up and the latencies must be >= 0")
        if self.num_coupled == 0 and (self.num_prefill == 0 or self.num_decode == 0):
            raise ConfigError("a cluster needs a prefill and a decode instance, or a coupled one")
        if self.leap_steps < 1:
            raise ConfigError("leap_steps must be >= 1")
        if (self.shared_cores is not None and self.shared_cores < 1) or self.core_threads < 1:
            raise ConfigError("shared_cores and core_threads must be >= 1")
        if self.instance.transfer.granularity != "request":
            raise ConfigError("the simulator hands KV over per request (chunk-level: not yet)")


@dataclass(slots=True)
class Trace:
    """What the gateway saw of one request (times in simulated seconds)."""

    request: SimRequest
    token_times: array = field(default_factory=lambda: array("d"))
    finish: float | None = None
    error: str | None = None
    recoveries: int = 0
    # The current attempt's entry instance (RequestHandle.prefill_instance): a recovery avoids it
    prefill_instance: str = ""


class SimCluster:
    def __init__(self, layout: Layout, costs: CostModel, requests: list[SimRequest],
                 seed: int = 0) -> None:
        self.layout, self.costs, self.seed = layout, costs, seed
        self.loop = EventLoop()
        self.cores = (SharedCores(self.loop, layout.shared_cores, layout.core_threads)
                      if layout.shared_cores else None)
        self.requests = sorted(requests, key=lambda r: r.arrival_s)
        self.output_lengths = {r.request_id: r.output_tokens for r in self.requests}
        self.traces: dict[str, Trace] = {}
        self.outstanding = len(self.requests)
        self.link, self.kv_bytes_per_token = self._link()
        self.max_model_len = layout.instance.engine.model.max_model_len or costs.max_model_len
        self.registry = InstanceRegistry(layout.gateway.instance_timeout_s)
        self.registry.address = GATEWAY  # reports echo the requests they have seen
        self.registry.managed_by_store = True  # readiness by report, never by the wall clock
        self.router = policies.router(self.registry, layout.gateway, costs)
        self.watcher = policies.watcher(layout.gateway)
        self.recent_ttfts: deque[float] = deque(maxlen=50)  # ClusterMonitor.recent_ttfts
        self.flips: list[dict] = []
        self.migrations = 0  # sequences handed back by draining decode instances
        self.transfer = {"count": 0, "tokens": 0, "link_seconds": 0.0}
        self._sampling: dict[int, SamplingParams] = {}
        self.instances = self._instances()

    def _link(self) -> tuple[Link, int]:
        emulation = self.layout.instance.transfer.emulation
        if self.layout.link is None and emulation.bandwidth is not None:
            return (Link(emulation.bandwidth, emulation.latency_s),
                    emulation.bytes_per_token or self.costs.kv_bytes_per_token)
        return link_named(self.layout.link or self.costs.default_link), \
            self.costs.kv_bytes_per_token

    def num_blocks(self) -> int:
        """Per instance: configured, else the hardware's capacity, else CacheConfig.memory_gib
        over the KV bytes of a block (as the engine sizes its pool)."""
        cache = self.layout.instance.engine.cache
        if cache.num_blocks:
            return cache.num_blocks
        if self.costs.kv_capacity_tokens:
            return self.costs.kv_capacity_tokens // cache.block_size
        return int(cache.memory_gib * 2**30 // (self.costs.kv_bytes_per_token * cache.block_size))

    def _instances(self) -> dict[str, SimInstance]:
        layout, cache = self.layout, self.layout.instance.engine.cache
        num_blocks, instances = self.num_blocks(), {}
        roles = ["prefill"] * layout.num_prefill + ["decode"] * layout.num_decode \
            + ["coupled"] * layout.num_coupled
        counts: dict[str, int] = {}
        for index, role in enumerate(roles):
            instance_id = f"{role}-{counts.setdefault(role, 0)}"
            counts[role] += 1
            kv = KVCacheManager(num_blocks, cache.block_size, cache.prefix_caching)
            instances[instance_id] = SimInstance(self, instance_id, role, layout.instance, kv,
                                                 seed=self.seed * 100_003 + index)
        return instances

    def sampling(self, request: SimRequest) -> SamplingParams:
        """Greedy, EOS-terminated, capped at max_tokens; shared between equal caps."""
        params = self._sampling.get(request.max_tokens)
        if params is None:
            params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0,
                                    eos_token_ids=(EOS_TOKEN,))
            self._sampling[request.max_tokens] = params
        return params

    # -- running -------------------------------------------------------------------------------
    def run(self) -> None:
        self.loop.at(0.0, self._tick)
        if self.requests:
            self.loop.at(self.requests[0].arrival_s, self._arrive, 0)
            horizon = self.requests[-1].arrival_s + self.layout.drain_limit_s
        else:
            horizon = 0.0
        self.loop.run(until=horizon)
        for trace in self.traces.values():
            if trace.finish is None:
                trace.error, trace.finish = "unfinished when the simulation ended", self.loop.now
        self.outstanding = 0

    def _arrive(self, index: int) -> None:
        request = self.requests[index]
        if index + 1 < len(self.requests):  # one arrival event in the heap at a time
            self.loop.at(self.requests[index + 1].arrival_s, self._arrive, index + 1)
        self.traces[request.request_id] = Trace(request)
        if not self._route(request, request.prompt_ids(index)):
            self.fail(request.request_id, "no instance can take the request")

    def _route(self, request: SimRequest, prompt_ids: list[int],
               exclude: frozenset = frozenset()) -> bool:
        """Gateway._send_attempt: False when no instance can take the request."""
        route = self.router.choose(prompt_ids, set(exclude))
        if route is None:
            return False
        target = route.target.stats.instance_id
        self.traces[request.request_id].prefill_instance = target
        self.registry.note_sent(route.target, len(prompt_ids))
        self.send(target, "generate", (request, prompt_ids, route.local_prefill))
        return True

    def refused(self, inst: SimInstance, payload: tuple) -> None:
        """An instance could not take a request (it flipped): its recoverable error reaches the
        gateway before any decode instance held the attempt, so only the attempt's target (the
        trace's prefill instance, `inst`) is avoided."""
        request, prompt_ids, _ = payload
        self._recover(self.traces[request.request_id], prompt_ids, "",
                      f"refused by {inst.instance_id}")

    def migrate(self, inst: SimInstance, seq: Sequence) -> None:
        """A sequence a draining decode instance hands back (flip_drain migrate): recovered
        from its prompt and generated tokens, avoiding that instance and the attempt's prefill
        instance."""
        self.migrations += 1
        self._recover(self.traces[seq.seq_id], list(seq.token_ids), inst.instance_id,
                      f"migrated from {inst.instance_id}")

    def _recover(self, trace: Trace, token_ids: list[int], decode_instance: str,
                 error: str) -> None:
        """Gateway._recover: not after max_recoveries nor once the output reached max_tokens;
        else routed without the attempt's instances, then (only they can take it) anywhere."""
        request = trace.request
        if trace.recoveries >= self.layout.gateway.max_recoveries \
                or len(trace.token_times) >= request.max_tokens:
            self.fail(request.request_id, error)
            return
        old = frozenset({trace.prefill_instance, decode_instance} - {""})
        trace.recoveries += 1
        if not self._route(request, token_ids, old) and not self._route(request, token_ids):
            trace.recoveries -= 1
            self.fail(request.request_id, error)

    def send(self, instance_id: str, kind: str, payload) -> None:
        target = self.instances[instance_id]
        delay = self.layout.message_latency_s + (self.layout.request_latency_s
                                                 if kind == "generate" else 0.0)
        if delay > 0:
            self.loop.after(delay, target.deliver, kind, payload)
        else:
            target.deliver(kind, payload)

    def start_transfer(self, inst: SimInstance, offer: KVTransferOffer, num_tokens: int) -> None:
        """The decode instance reads `num_tokens` of KV over its link (first come first
        served); the sequence is received when the last byte has landed."""
        now = self.loop.now
        start = max(now, inst.link_free_at)
        inst.link_free_at = start + num_tokens * (
            self.kv_bytes_per_token * self.link.occupancy_per_byte
            + self.layout.handoff_per_token_s)
        done = inst.link_free_at + self.link.latency_s + self.layout.handoff_s
        self.transfer["count"] += 1
        self.transfer["tokens"] += num_tokens
        self.transfer["link_seconds"] += done - start
        self.loop.at(done, inst.deliver, "received", offer)

    # -- what the gateway streams ----------------------------------------------------------------
    def on_token(self, request_id: str, finish_reason: str | None) -> None:
        self.on_token_at(request_id, finish_reason, self.loop.now)

    def on_token_at(self, request_id: str, finish_reason: str | None, now: float) -> None:
        """A token streamed at simulated time `now` (a steady leap absorbs its forwards after
        their end)."""
        trace = self.traces[request_id]
        if not trace.token_times:
            self.recent_ttfts.append(now - trace.request.arrival_s)
        trace.token_times.append(now)
        if finish_reason is not None:
            trace.finish = now
            self.outstanding -= 1

    def fail(self, request_id: str, error: str) -> None:
        trace = self.traces[request_id]
        trace.error, trace.finish = error, self.loop.now
        self.outstanding -= 1

    # -- the monitor -------------------------------------------------------------------------------
    def _tick(self) -> None:
        """ClusterMonitor: reports in, the view out to prefill instances, the watcher."""
        for inst in self.instances.values():
            self.registry.report(inst.stats())
        view = ClusterView(self.registry.decode_peers(), self.loop.now)
        for inst in self.instances.values():
            if inst.role.name == "prefill":
                inst.deliver("view", view)
        self._watch()
        if self.outstanding > 0:  # afterwards the last acknowledgements drain without views
            self.loop.after(self.layout.gateway.broadcast_interval_s, self._tick)

    def _watch(self) -> None:
        """ClusterMonitor._watch, with the snapshot stamped in simulated time."""
        states = list(self.registry.instances.values())
        in_flight = any(s.draining for s in states)
        routable = [s.stats for s in states if not s.draining]
        ttft = sum(self.recent_ttfts) / len(self.recent_ttfts) if self.recent_ttfts else None
        decision = self.watcher.step(PoolSnapshot(self.loop.now, routable, ttft), in_flight)
        if decision is not None:
            self._flip(decision)

    def _flip(self, decision: FlipDecision) -> None:
        """ClusterMonitor.flip's checks, then the instance drains (FlipCommand)."""
        state = self.registry.get(decision.instance_id)
        if state is None or state.draining or state.stats.role == decision.target_role \
                or decision.target_role not in ("prefill", "decode") \
                or len(self.registry.routable(state.stats.role)) <= 1:
            return
        self.registry.mark_flipping(decision.instance_id, decision.target_role)
        self.flips.append({"instance_id": decision.instance_id, "from": state.stats.role,
                           "to": decision.target_role, "reason": decision.reason,
                           "start_s": self.loop.now, "end_s": None})
        self.instances[decision.instance_id].begin_flip(decision.target_role)

    def flip_done(self, inst: SimInstance) -> None:
        for flip in reversed(self.flips):
            if flip["instance_id"] == inst.instance_id and flip["end_s"] is None:
                flip["end_s"] = self.loop.now
                break
        self.registry.report(inst.stats())  # the worker reports its new role at once

    @property
    def duration_s(self) -> float:
        return self.loop.now if not math.isinf(self.loop.now) else 0.0
