"""One simulation: (layout, cost model, workload, seed) -> the metrics dict `splitserve bench`
reports, plus a `simulation` section (simulated and wall seconds, flips, transfers, KV check).

    from simulator.run import simulate
    report = simulate(Layout(num_prefill=2, num_decode=2), costs, requests, seed=0)
    report["ttft_s"]["p99"], report["goodput"]["fraction"]

Policies are named in the layout's configs exactly as `splitserve up` takes them (the
InstanceConfig and GatewayConfig fields); later studies (validation against real runs, the
at-scale crossover, `splitserve plan`) call `simulate` in a loop.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass

from common.block_pool import BlockPoolError
from simulator.cluster import Layout, SimCluster
from simulator.costs import CostModel
from simulator.metrics import goodput, run_duration, summarize
from simulator.workload import SimRequest


@dataclass(frozen=True)
class Slo:
    """The goodput SLOs (defaults chosen here: 1 s to first token, 100 ms p99 between tokens).
    A request's TTFT bound is `ttft_s + ttft_per_prompt_token_s x its prompt tokens` (0: the
    same bound for every prompt, as `splitserve bench` has it)."""

    ttft_s: float = 1.0
    tbt_s: float = 0.1
    tbt_percentile: float = 99.0
    ttft_per_prompt_token_s: float = 0.0


def simulate(layout: Layout, costs: CostModel, workload: list[SimRequest], seed: int = 0,
             slo: Slo = Slo()) -> dict:
    return report(*run_cluster(layout, costs, workload, seed), slo)


def run_cluster(layout: Layout, costs: CostModel, workload: list[SimRequest],
                seed: int = 0) -> tuple[SimCluster, float, float]:
    """The simulated cluster after the run (its traces), and the run's wall and CPU seconds."""
    cluster = SimCluster(layout, costs, workload, seed)
    wall, cpu = time.perf_counter(), time.process_time()
    cluster.run()
    return cluster, time.perf_counter() - wall, time.process_time() - cpu


def slo_goodput(traces: list, duration_s: float, slo: Slo) -> dict:
    return goodput(traces, duration_s, slo.ttft_s, slo.tbt_s, slo.tbt_percentile,
                   slo.ttft_per_prompt_token_s)


def without_wall_time(result: dict, *also: str) -> dict:
    """A report less what depends on the machine's speed (and the simulation section's `also`
    keys): two runs of the same requests must agree on the rest."""
    dropped = ("wall_s", "cpu_s", "simulated_s_per_wall_s", *also)
    return {**result, "simulation": {k: v for k, v in result["simulation"].items()
                                     if k not in dropped}}


def report(cluster: SimCluster, wall_s: float, cpu_s: float, slo: Slo = Slo()) -> dict:
    """`splitserve bench`'s metrics of a finished run, its goodput under `slo`, and the
    simulation section."""
    traces = list(cluster.traces.values())
    duration = run_duration(traces)
    result = summarize(traces, duration)
    result["goodput"] = slo_goodput(traces, duration, slo)
    result["simulation"] = simulation_section(cluster, wall_s, cpu_s)
    result["slo"] = asdict(slo)
    return result


def simulation_section(cluster: SimCluster, wall_s: float, cpu_s: float) -> dict:
    simulated = cluster.loop.now
    instances = cluster.instances.values()
    return {
        "simulated_s": simulated, "wall_s": wall_s, "cpu_s": cpu_s,
        "simulated_s_per_wall_s": simulated / wall_s if wall_s > 0 else None,
        "events": cluster.loop.num_events,
        "forwards": sum(i.num_forwards for i in instances),
        "instances": {"count": len(cluster.instances),
                      "final_roles": dict(Counter(i.role.name for i in instances)),
                      "busy_instance_s": sum(i.busy_seconds for i in instances),
                      "num_blocks_each": cluster.num_blocks()},
        "preemptions": sum(getattr(i.role.scheduler, "num_preemptions", 0) for i in instances),
        "flips": cluster.flips,
        "migrations": cluster.migrations,
        "transfers": dict(cluster.transfer),
        "kv_check": kv_check(cluster),
        "prefix_cache": {  # KVCacheManager.stats, summed: tokens looked up and found cached
            "queries": sum(i.kv.stats.queries for i in instances),
            "hits": sum(i.kv.stats.hits for i in instances)},
        "cost_model": cluster.costs.source,
        "link": {"bandwidth_bytes_per_s": cluster.link.bandwidth,
                 "latency_s": cluster.link.latency_s,
                 "kv_bytes_per_token": cluster.kv_bytes_per_token},
    }


def kv_check(cluster: SimCluster) -> dict:
    """After the run: every instance's block pool is consistent, and blocks are held only by
    sequences still live there (none, when every request ended)."""
    leaked, errors = 0, []
    for inst in cluster.instances.values():
        live = inst.role.live_seq_ids()
        try:
            inst.kv.check_integrity(live)
        except BlockPoolError as exc:
            errors.append(f"{inst.instance_id}: {exc}")
        if not live:
            leaked += inst.kv.num_blocks - inst.kv.num_free_blocks
    return {"leaked_blocks": leaked, "errors": errors}
