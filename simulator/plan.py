"""`splitserve plan`: simulate candidate layouts for an instance budget and rank them by goodput.

A `Candidate` is one way to spend N instances: P prefill + D decode instances (optionally
flipping between the pools), or N co-located instances under one policy; each with a ChunkSize
(prefill instances: `PrefillConfig.chunk_size`; a co-located policy: its per-iteration token
budget `max_num_batched_tokens`, Sarathi-Serve's chunk) and a decode admission policy.
`evaluate` runs a candidate once per seed on the same requests the other candidates get and
reports goodput per instance: the requests meeting both SLOs, per second of the arrival window,
per instance (the offered rate times the fraction that met them, so a run's drain does not
count against it). `rank` orders candidates by mean goodput and marks which ones are not
distinguishable from the best: the best does not beat them on every seed.

The CLI side (flags, workload, table, JSON) is simulator/plan_cli.py; the at-scale study
(simulator/study.py) calls `evaluate` over its grid.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from common.config import ConfigError, GatewayConfig, InstanceConfig, RoutingConfig
from simulator.cluster import Layout
from simulator.costs import CostModel
from simulator.run import Slo, report, run_cluster, slo_goodput
from simulator.workload import SimRequest

# Flips in a short simulation: the watcher's defaults (10 s cooldown) are for hours of traffic.
FLIP_WATCH = (("cooldown_s", 2.0), ("sustain_ticks", 3.0))


@dataclass(frozen=True)
class Candidate:
    num_prefill: int = 0
    num_decode: int = 0
    num_coupled: int = 0
    policy: str | None = None  # co-located policy (num_coupled > 0)
    flip_policy: str = "none"  # disaggregated: the gateway's flip policy
    chunk_size: int | None = None  # None: the cost model's (profile knee) / the batch default
    admission: str = "greedy"  # decode admission (disaggregated)

    def __post_init__(self) -> None:
        if (self.num_coupled > 0) == (self.num_prefill + self.num_decode > 0):
            raise ConfigError("a candidate is either P prefill + D decode or N co-located")
        if self.num_coupled and not self.policy:
            raise ConfigError("a co-located candidate needs a policy")

    @property
    def instances(self) -> int:
        return self.num_prefill + self.num_decode + self.num_coupled

    @property
    def label(self) -> str:
        if self.num_coupled:
            name = f"{self.policy} x{self.num_coupled}"
        else:
            name = f"{self.num_prefill}P:{self.num_decode}D"
            name += f"+{self.flip_policy}" if self.flip_policy != "none" else ""
            name += f" {self.admission}" if self.admission != "greedy" else ""
        return name + (f" chunk {self.chunk_size}" if self.chunk_size else "")


def layout(candidate: Candidate, instance: InstanceConfig | None = None,
           gateway: GatewayConfig | None = None, flip_options: tuple = (),
           fixed: dict | None = None) -> Layout:
    """The cluster a candidate describes, on top of `splitserve up`'s configs (TetriInfer's pure
    disaggregation by default: no local prefill on decode instances); `fixed`: Layout fields
    the same in every candidate (the serving stack's own times, simulator.args.stack_times;
    the machine's shared cores, simulator.args.core_sharing)."""
    instance = instance or InstanceConfig()
    gateway = gateway or GatewayConfig(routing=RoutingConfig(local_prefill="off"))
    if candidate.num_coupled:
        batch = instance.engine.batch
        if candidate.chunk_size:
            batch = replace(batch, max_num_batched_tokens=candidate.chunk_size)
        instance = replace(instance, coupled_policy=candidate.policy,
                           engine=replace(instance.engine, batch=batch))
    else:
        instance = replace(
            instance, decode=replace(instance.decode, admission=candidate.admission),
            prefill=replace(instance.prefill, chunk_size=candidate.chunk_size or
                            instance.prefill.chunk_size))
        options = (tuple(flip_options) or FLIP_WATCH) if candidate.flip_policy != "none" else ()
        gateway = replace(gateway, flip_policy=candidate.flip_policy, flip_options=options)
    return Layout(num_prefill=candidate.num_prefill, num_decode=candidate.num_decode,
                  num_coupled=candidate.num_coupled, instance=instance, gateway=gateway,
                  **(fixed or {}))


def candidates(budget: int, prefill_fractions: Sequence[float] = (0.25, 0.5, 0.75),
               policies: Sequence[str] = ("vllm", "sarathi"),
               flip_policies: Sequence[str] = ("none",), chunk_sizes: Sequence[int | None] = (None,),
               admissions: Sequence[str] = ("greedy",)) -> list[Candidate]:
    """Every combination, P = round(fraction x budget) kept within 1..budget-1, duplicates
    dropped; co-located candidates take the ChunkSizes, disaggregated ones everything."""
    if budget < 1:
        raise ConfigError("the instance budget must be >= 1")
    found: dict[Candidate, None] = {}
    if budget >= 2:
        for fraction in prefill_fractions:
            p = min(max(round(fraction * budget), 1), budget - 1)
            for flip in flip_policies:
                for chunk in chunk_sizes:
                    for admission in admissions:
                        found[Candidate(p, budget - p, flip_policy=flip, chunk_size=chunk,
                                        admission=admission)] = None
    for policy in policies:
        for chunk in chunk_sizes:
            found[Candidate(num_coupled=budget, policy=policy, chunk_size=chunk)] = None
    return list(found)


def run_one(candidate: Candidate, costs: CostModel, requests: list[SimRequest], seed: int,
            slos: Sequence[Slo], base: Callable[[Candidate], Layout] = layout) -> dict:
    """One simulation: bench's metrics under the first SLO, and goodput per instance under each
    SLO (requests meeting it / arrival window / instances)."""
    cluster, wall, cpu = run_cluster(base(candidate), costs, requests, seed)
    result = report(cluster, wall, cpu, slos[0])
    traces = list(cluster.traces.values())
    window = arrival_window(requests)
    result["goodput_per_instance"] = [
        slo_goodput(traces, 0.0, slo)["num_met"] / window / candidate.instances for slo in slos]
    return result


def arrival_window(requests: Sequence[SimRequest]) -> float:
    """Seconds over which the requests arrive: count / rate, estimated as n x the mean gap."""
    times = sorted(r.arrival_s for r in requests)
    if len(times) < 2 or times[-1] <= times[0]:
        return 1.0
    return (times[-1] - times[0]) * len(times) / (len(times) - 1)


def spread(values: Sequence[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "per_seed": list(values)}


def summary(candidate: Candidate, runs: Sequence[dict]) -> dict:
    """Per candidate: goodput per instance over the seeds under the first SLO (and under each
    SLO, `goodput_per_instance_by_slo`), the latencies behind it, and what the runs cost."""
    by_slo = [spread([r["goodput_per_instance"][i] for r in runs])
              for i in range(len(runs[0]["goodput_per_instance"]))]
    mean = lambda key, sub: statistics.fmean(r[key][sub] or 0.0 for r in runs)
    return {
        "candidate": candidate.label, "layout": vars(candidate).copy(),
        "goodput_per_instance": by_slo[0], "goodput_per_instance_by_slo": by_slo,
        "slo_attainment": statistics.fmean(r["goodput"]["fraction"] or 0.0 for r in runs),
        "ttft_p99_s": mean("ttft_s", "p99"), "tbt_p99_s": mean("tbt_s", "p99"),
        "tpot_mean_s": mean("tpot_s", "mean"), "jct_mean_s": mean("jct_s", "mean"),
        "flips": statistics.fmean(len(r["simulation"]["flips"]) for r in runs),
        "preemptions": statistics.fmean(r["simulation"]["preemptions"] for r in runs),
        "errors": sum(r["num_errors"] for r in runs),
        "output_tokens": sum(r["total_output_tokens"] for r in runs),
        "cpu_s": sum(r["simulation"]["cpu_s"] for r in runs)}


def evaluate(candidate: Candidate, costs: CostModel, workloads: dict[int, list[SimRequest]],
             slos: Sequence[Slo], base: Callable[[Candidate], Layout] = layout) -> tuple[dict,
                                                                                     list]:
    """`summary` of the candidate run once per seed (`workloads`: seed -> requests), and the
    runs."""
    runs = [run_one(candidate, costs, requests, seed, slos, base)
            for seed, requests in workloads.items()]
    return summary(candidate, runs), runs


def paired_verdict(a: dict, b: dict) -> int:
    """+1 when `a` (a goodput spread) beats `b` on every seed, -1 when it loses on every seed,
    0 otherwise: the difference changes sign, or is zero, within the seeds' spread. Candidates
    run the same requests per seed, so seeds pair up."""
    diffs = [x - y for x, y in zip(a["per_seed"], b["per_seed"])]
    return 1 if all(d > 0 for d in diffs) else -1 if all(d < 0 for d in diffs) else 0


def rank(rows: list[dict]) -> list[dict]:
    """Best mean goodput first (ties: higher SLO attainment, then lower p99 TTFT, then lower
    p99 TBT); each row gains `distinguishable`: whether the best beats it on every seed (else
    the difference is inside the seeds' spread)."""
    ordered = sorted(rows, key=lambda r: (-r["goodput_per_instance"]["mean"],
                                          -r["slo_attainment"], r["ttft_p99_s"], r["tbt_p99_s"]))
    if ordered:
        best = ordered[0]["goodput_per_instance"]
        for row in ordered:
            row["distinguishable"] = row is ordered[0] or \
                paired_verdict(best, row["goodput_per_instance"]) > 0
    return ordered
