"""Where the gateway sends a request: the prefix index, route policies, conditional
disaggregation.

`PrefixIndex` mirrors each instance's prefix cache from its `KVCacheEvents` (deltas, and a full
snapshot every few seconds), so every gateway replica sees the same picture whether the events
come over its inbox or the store's pub/sub. A request's cached prefix on an instance is the run of
its leading block hashes (common.block_pool's chained hashes, computed here from the prompt's
token ids) that the instance holds.

Route policies pick the entry instance (a prefill or co-located one) by name
(`common.plugins.ROUTE_POLICIES`):

    least_loaded  fewest prompt tokens queued (reported + sent since the report)
    cache_aware   least expected prefill work: queued tokens + the prompt's uncached tokens,
                  a cached token counting `overlap_weight` (Dynamo's KV router and SGLang's
                  cache-aware router weigh overlap against load the same way)

Conditional disaggregation (Dynamo's): with `local_prefill` on, a request whose prompt a decode
instance holds cached except for at most `local_prefill_tokens` tokens (a later turn of a
conversation it decoded, or simply a short prompt) goes straight to that decode instance, which
prefills the rest between decode steps: no prefill queue, no KV transfer. Only a decode instance
with nothing queued beyond that budget takes one, so its decodes' TBT stays near one step.
`auto` takes each decode instance's budget from the `splitserve profile` record measured for its
forwards (model, dtype, threads): the largest profiled prefill whose forward fits in
`local_prefill_tbt_s` (default 0.1 s), so a decode step that carries a local prefill stays
within that TBT.

The decode instances a request's prompt is cached on travel with it
(`GenerateRequest.decode_cached_tokens`), for the prefill instance's dispatcher.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from common.block_pool import iter_block_hashes
from common.config import GatewayConfig, RoutingConfig
from common.plugins import ROUTE_POLICIES
from common.protocol import InstanceStats, KVCacheEvents
from common.profile_record import ProfileIdentity, read_record
from control_plane.cluster import InstanceRegistry, InstanceState

log = logging.getLogger(__name__)



class PrefixIndex:
    """Instance id -> the block hashes its prefix cache holds, as its events last said."""

    def __init__(self) -> None:
        self.hashes: dict[str, set[int]] = {}
        self.block_sizes: dict[str, int] = {}

    def apply(self, events: KVCacheEvents) -> None:
        held = self.hashes.setdefault(events.instance_id, set())
        if events.snapshot:
            held.clear()
        held.difference_update(events.removed)
        held.update(events.stored)
        self.block_sizes[events.instance_id] = events.block_size

    def forget(self, instance_id: str) -> None:
        self.hashes.pop(instance_id, None)
        self.block_sizes.pop(instance_id, None)


@dataclass
class PromptHashes:
    """A prompt's leading block hashes per block size, computed once per request."""

    token_ids: list[int]
    by_size: dict[int, list[int]] = field(default_factory=dict)

    def cached_tokens(self, index: PrefixIndex, instance_id: str) -> int:
        """Prompt tokens whose KV the instance holds (whole blocks, as a lookup there would
        find them, leaving the last token to compute)."""
        held = index.hashes.get(instance_id)
        if not held:
            return 0
        size = index.block_sizes[instance_id]
        if size not in self.by_size:
            self.by_size[size] = list(iter_block_hashes(self.token_ids, size,
                                                        len(self.token_ids) - 1))
        count = 0
        for block_hash in self.by_size[size]:
            if block_hash not in held:
                break
            count += 1
        return count * size


@dataclass
class Route:
    target: InstanceState
    local_prefill: bool = False  # the target is a decode instance that prefills it itself
    decode_cached_tokens: dict[str, int] = field(default_factory=dict)


def queued_tokens(state: InstanceState) -> int:
    return state.stats.num_queued_tokens + state.sent_tokens_since_report


class RoutePolicy:
    """Picks the entry instance among candidates (prefill or co-located instances)."""

    def __init__(self, config: RoutingConfig, index: PrefixIndex) -> None:
        self.config, self.index = config, index

    def pick(self, candidates: list[InstanceState], prompt: PromptHashes) -> InstanceState:
        raise NotImplementedError


class LeastLoaded(RoutePolicy):
    def pick(self, candidates, prompt):
        return min(candidates, key=lambda s: (
            queued_tokens(s), s.stats.num_waiting + s.sent_requests_since_report,
            s.stats.instance_id))


class CacheAware(RoutePolicy):
    def pick(self, candidates, prompt):
        def work(state: InstanceState) -> float:
            cached = prompt.cached_tokens(self.index, state.stats.instance_id)
            uncached = len(prompt.token_ids) - self.config.overlap_weight * cached
            return queued_tokens(state) + uncached
        return min(candidates, key=lambda s: (work(s), s.stats.num_waiting,
                                              s.stats.instance_id))


class LocalPrefillBudget:
    """The uncached-token budget under which a decode instance prefills a request itself: -1
    (off), the configured threshold (on), or, in auto, the largest prefill within
    `local_prefill_tbt_s` in the profile record measured for that instance's forwards (its
    model, dtype and threads, as its reports say; common.profile_record), else the threshold.
    `fixed` sets one budget for every instance (the simulator's: one cost model for all)."""

    def __init__(self, config: RoutingConfig, cache_dir: str | None = None,
                 fixed: int | None = None) -> None:
        self.config, self.cache_dir, self.fixed = config, cache_dir, fixed
        if config.local_prefill == "off":
            self.fixed = -1
        elif config.local_prefill == "on" or (fixed is None and not cache_dir):
            self.fixed = config.local_prefill_tokens
        self._by_identity: dict[ProfileIdentity, int] = {}

    @property
    def enabled(self) -> bool:
        return self.fixed is None or self.fixed >= 0

    def __call__(self, stats: InstanceStats) -> int:
        if self.fixed is not None:
            return self.fixed
        identity = ProfileIdentity(stats.model or None, stats.dtype or None,
                                   stats.num_threads or None)
        if identity not in self._by_identity:
            self._by_identity[identity] = self._from_record(identity)
        return self._by_identity[identity]

    def _from_record(self, identity: ProfileIdentity) -> int:
        try:
            record = read_record(self.cache_dir, identity)
            fits = [p["tokens"] for p in record["prefill"]
                    if p["seconds"] <= self.config.local_prefill_tbt_s]
        except (KeyError, TypeError):  # no record for these forwards, or one without curves
            log.info("local prefill budget %d tokens for %s (no profile record for them)",
                     self.config.local_prefill_tokens, identity)
            return self.config.local_prefill_tokens
        budget = max(fits, default=self.config.local_prefill_tokens)
        log.info("local prefill budget %d tokens for %s (from the profile record)", budget,
                 identity)
        return budget


class Router:
    def __init__(self, registry: InstanceRegistry, config: RoutingConfig, policy: RoutePolicy,
                 index: PrefixIndex, local_budget: LocalPrefillBudget) -> None:
        self.registry, self.config, self.policy = registry, config, policy
        self.index, self.local_budget = index, local_budget

    def choose(self, token_ids: list[int], exclude: set[str] = frozenset(), prefer: str = ""
               ) -> Route | None:
        """Where to send a prompt; `prefer`, an instance id, wins while it can take it."""
        preferred = self._preferred(prefer, exclude)
        if preferred is not None:
            return preferred
        prompt = PromptHashes(token_ids)
        decodes = [d for d in self.registry.routable("decode")
                   if d.stats.instance_id not in exclude]
        cached = {d.stats.instance_id: prompt.cached_tokens(self.index, d.stats.instance_id)
                  for d in decodes}
        local = self._local_target(decodes, cached, len(token_ids))
        if local is not None:
            return Route(local, local_prefill=True)
        candidates = [s for s in self.registry.entry_points()
                      if s.stats.instance_id not in exclude]
        if not candidates:
            return None
        return Route(self.policy.pick(candidates, prompt),
                     decode_cached_tokens={k: v for k, v in cached.items() if v})

    def _preferred(self, prefer: str, exclude: set[str]) -> Route | None:
        if not prefer or prefer in exclude:
            return None
        if any(s.stats.instance_id == prefer for s in self.registry.entry_points()):
            return Route(self.registry.get(prefer))
        if any(d.stats.instance_id == prefer and self.local_budget(d.stats) >= 0
               for d in self.registry.routable("decode")):
            return Route(self.registry.get(prefer), local_prefill=True)
        return None

    def _local_target(self, decodes: list[InstanceState], cached: dict[str, int],
                      num_tokens: int) -> InstanceState | None:
        """The decode instance that can prefill this prompt itself within the budget: least
        uncached work first, then least queued."""
        if not self.local_budget.enabled:
            return None
        def uncached(d: InstanceState) -> int:
            return num_tokens - cached[d.stats.instance_id]
        # the queued tokens count too: the instance takes this prefill only if its whole queue
        # of prompt work stays within the budget
        fits = [d for d in decodes
                if queued_tokens(d) + uncached(d) <= self.local_budget(d.stats)
                and d.stats.num_free_blocks * self._block_size(d) >= num_tokens]
        return min(fits, key=lambda d: (uncached(d), queued_tokens(d), d.stats.instance_id),
                   default=None)

    def _block_size(self, state: InstanceState) -> int:
        return self.index.block_sizes.get(state.stats.instance_id, 16)


def make_router(registry: InstanceRegistry, config: GatewayConfig) -> Router:
    routing, index = config.routing, PrefixIndex()
    policy = ROUTE_POLICIES.get(routing.policy)(routing, index)
    return Router(registry, routing, policy, index,
                  LocalPrefillBudget(routing, config.cache_dir))
