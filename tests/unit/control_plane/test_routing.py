"""The gateway's routing: the prefix index from KV events, cache-aware and least-loaded choice of
the entry instance, and conditional disaggregation to a decode instance."""

from __future__ import annotations

import pytest

from common.block_pool import iter_block_hashes
from common.config import RoutingConfig
from common.profile_record import write_record
from common.protocol import InstanceStats, KVCacheEvents
from control_plane.cluster import InstanceRegistry
from control_plane.routing import (
    CacheAware,
    LeastLoaded,
    PrefixIndex,
    PromptHashes,
    LocalPrefillBudget,
    Router,
)

BS = 16
PROMPT = list(range(1000, 1200))  # 200 tokens: 12 full blocks before the last token


def stats(instance_id, role, queued=0, free=1000):
    return InstanceStats(instance_id, role, f"tcp://{instance_id}:1", f"tcp://{instance_id}:2",
                         "m", 4096, num_total_blocks=1000, num_free_blocks=free,
                         num_queued_tokens=queued)


def cluster(*instances) -> InstanceRegistry:
    registry = InstanceRegistry(instance_timeout_s=60.0)
    for instance in instances:
        registry.report(instance)
    return registry


def holding(index: PrefixIndex, instance_id: str, tokens: list[int]) -> None:
    index.apply(KVCacheEvents(instance_id, BS, list(iter_block_hashes(tokens, BS))))


def router(registry, index, policy="cache_aware", budget=-1, **config) -> Router:
    routing = RoutingConfig(policy=policy, **config)
    cls = {"cache_aware": CacheAware, "least_loaded": LeastLoaded}[policy]
    return Router(registry, routing, cls(routing, index), index,
                  LocalPrefillBudget(routing, fixed=budget))


def test_index_applies_deltas_and_snapshots():
    index = PrefixIndex()
    index.apply(KVCacheEvents("p0", BS, [1, 2, 3]))
    index.apply(KVCacheEvents("p0", BS, [4], removed=[2]))
    assert index.hashes["p0"] == {1, 3, 4}
    index.apply(KVCacheEvents("p0", BS, [9], snapshot=True))
    assert index.hashes["p0"] == {9}
    index.forget("p0")
    assert not index.hashes and not index.block_sizes


def test_cached_tokens_count_the_leading_run_of_blocks_only():
    index = PrefixIndex()
    holding(index, "p0", PROMPT[:64])
    prompt = PromptHashes(PROMPT)
    assert prompt.cached_tokens(index, "p0") == 64
    other = PromptHashes([7] + PROMPT[1:])  # first block differs: nothing after it counts
    assert other.cached_tokens(index, "p0") == 0
    assert prompt.cached_tokens(index, "p1") == 0


def test_cache_aware_weighs_cached_tokens_against_queued_work():
    registry = cluster(stats("p0", "prefill", queued=100), stats("p1", "prefill", queued=0),
                       stats("d0", "decode"))
    index = PrefixIndex()
    holding(index, "p0", PROMPT)  # 192 of 200 tokens cached on p0
    # p0: 100 queued + 8 uncached < p1: 0 + 200
    assert router(registry, index).choose(PROMPT).target.stats.instance_id == "p0"
    assert router(registry, index, "least_loaded").choose(PROMPT).target.stats.instance_id \
        == "p1"
    registry.get("p0").stats.num_queued_tokens = 300  # now the queue outweighs the cache
    assert router(registry, index).choose(PROMPT).target.stats.instance_id == "p1"
    assert router(registry, index).choose(PROMPT, exclude={"p1"}).target.stats.instance_id \
        == "p0"


def test_decode_instances_holding_the_prompt_ride_along_for_the_dispatcher():
    registry = cluster(stats("p0", "prefill"), stats("d0", "decode"), stats("d1", "decode"))
    index = PrefixIndex()
    holding(index, "d1", PROMPT[:96])
    route = router(registry, index).choose(PROMPT)
    assert not route.local_prefill and route.decode_cached_tokens == {"d1": 96}


def test_conditional_disaggregation_sends_a_mostly_cached_prompt_to_its_decode_instance():
    registry = cluster(stats("p0", "prefill"), stats("d0", "decode"), stats("d1", "decode"))
    index = PrefixIndex()
    holding(index, "d1", PROMPT)  # 192 cached: 8 to prefill
    route = router(registry, index, budget=64).choose(PROMPT)
    assert route.local_prefill and route.target.stats.instance_id == "d1"
    # a short prompt needs no cache: the least queued decode instance takes it
    registry.get("d0").stats.num_queued_tokens = 10
    short = router(registry, index, budget=64).choose(list(range(40)))
    assert short.local_prefill and short.target.stats.instance_id == "d1"
    # a long uncached prompt goes to a prefill instance; so does anything with local prefill off
    assert not router(registry, index, budget=64).choose(list(range(500))).local_prefill
    assert not router(registry, index, budget=-1).choose(PROMPT).local_prefill


def test_a_busy_decode_instance_takes_no_local_prefill():
    registry = cluster(stats("p0", "prefill"), stats("d0", "decode", queued=60))
    route = router(registry, PrefixIndex(), budget=64).choose(list(range(40)))
    assert not route.local_prefill and route.target.stats.instance_id == "p0"


def instance(model="m", dtype="float32", threads=1, instance_id="d0"):
    return InstanceStats(instance_id, "decode", "tcp://x:1", "tcp://x:2", model, 4096,
                         num_total_blocks=1000, num_free_blocks=1000, dtype=dtype,
                         num_threads=threads)


def test_local_prefill_budget_modes(tmp_path):
    d = instance()
    assert LocalPrefillBudget(RoutingConfig(local_prefill="off"), str(tmp_path))(d) == -1
    assert LocalPrefillBudget(RoutingConfig(local_prefill="on", local_prefill_tokens=50),
                              str(tmp_path))(d) == 50
    assert LocalPrefillBudget(RoutingConfig(local_prefill_tokens=70), str(tmp_path))(d) == 70
    assert LocalPrefillBudget(RoutingConfig(local_prefill_tokens=70), None)(d) == 70
    write_record(tmp_path, {
        "model": "m", "dtype": "float32", "threads": 1,
        "prefill": [{"tokens": 16, "seconds": 0.01}, {"tokens": 64, "seconds": 0.03},
                    {"tokens": 256, "seconds": 0.09}],
        "decode": [{"batch": 1, "step_seconds": 0.01}, {"batch": 32, "step_seconds": 0.04},
                   {"batch": 64, "step_seconds": 0.08}]})
    # the largest profiled prefill within the TBT target (default 0.1 s)
    assert LocalPrefillBudget(RoutingConfig(), str(tmp_path))(d) == 256
    assert LocalPrefillBudget(RoutingConfig(local_prefill_tbt_s=0.05), str(tmp_path))(d) == 64
    # an instance that does not say what it runs takes the last record
    assert LocalPrefillBudget(RoutingConfig(), str(tmp_path))(instance("", "", 0)) == 256


def test_each_decode_instance_gets_the_budget_of_the_record_measured_for_its_forwards(tmp_path):
    def curve(seconds):
        return [{"tokens": n, "seconds": s} for n, s in zip((16, 64, 256), seconds)]
    write_record(tmp_path, {"model": "m", "dtype": "float32", "threads": 1,
                            "prefill": curve((0.02, 0.08, 0.3))})
    write_record(tmp_path, {"model": "m", "dtype": "float32", "threads": 2,
                            "prefill": curve((0.01, 0.04, 0.09))})  # the last record
    budget = LocalPrefillBudget(RoutingConfig(), str(tmp_path))
    assert budget(instance(threads=2)) == 256
    assert budget(instance(threads=1)) == 64  # not the last record's 256
    # no record for these forwards: the configured threshold, not another machine's curve
    assert budget(instance(threads=4)) == RoutingConfig().local_prefill_tokens
    assert budget(instance(dtype="bfloat16", threads=2)) == RoutingConfig().local_prefill_tokens
    registry = cluster(stats("p0", "prefill"), instance(threads=1, instance_id="d1"),
                       instance(threads=2, instance_id="d2"))
    routing, index = RoutingConfig(), PrefixIndex()
    router = Router(registry, routing, CacheAware(routing, index), index, budget)
    # 100 uncached tokens fit d2's budget only
    route = router.choose(list(range(100)))
    assert route.local_prefill and route.target.stats.instance_id == "d2"
    assert router.choose(list(range(300))).target.stats.instance_id == "p0"


@pytest.mark.parametrize("local", ["off", "on", "auto"])
def test_routing_flags_reach_the_gateway_config(local):
    from control_plane.cli import build_parser
    from control_plane.cli_args import gateway_config

    args = build_parser().parse_args(["up", "--route-policy", "least_loaded", "--local-prefill",
                                      local, "--local-prefill-tokens", "77"])
    routing = gateway_config(args, 0).routing
    assert (routing.policy, routing.local_prefill, routing.local_prefill_tokens) == \
        ("least_loaded", local, 77)


def test_every_gateway_replica_applies_cache_events_the_leader_alone_records_flips():
    from common.protocol import FlipReport
    from common.store import InProcessStore
    from control_plane.monitor import ClusterMonitor

    applied, flips = [], []
    monitor = ClusterMonitor(InstanceRegistry(60.0), InProcessStore(), None, "g1", 0.1, None,
                             lambda removed: None, on_kv_events=applied.append)
    monitor.on_flip_report = flips.append
    events = [KVCacheEvents("d0", BS, [1, 2]), FlipReport("f", "d0", "decode", "prefill", 0, 0, 0)]
    monitor._apply(None, True, False, events)  # not the leader
    assert applied == events[:1] and flips == []
