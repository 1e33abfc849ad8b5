"""`splitserve plan`: the candidates from the flags, the workload per seed, the ranked table or
JSON (the ranking itself is simulator/plan.py).

control_plane/cli.py registers the command with `splitserve up`'s flags (the base every
candidate starts from: KV blocks, batch limits, routing, transfer emulation) plus
simulator.args.add_plan_args, and calls `run_from_args` (imported in its handler only).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

from common.config import ConfigError, GatewayConfig, InstanceConfig
from simulator import pools as class_pools
from simulator.args import core_sharing, stack_times
from simulator.cli import cost_model
from simulator.cli import workload as simulate_workload
from simulator.plan import candidates, evaluate, layout, rank
from simulator.run import Slo
from simulator.workload import SimRequest

STUDY_POOLS = Path(__file__).resolve().parent.parent / \
    "docs/benchmarks/simulator_crossover/pools.json"
POOLS_NAME = "simulator-class-pools.json"


def split(text: str | None, kind=str) -> list:
    return [kind(item) for item in (text or "").split(",") if item.strip()]


def plan_candidates(args: argparse.Namespace) -> list:
    chunks = split(args.chunk_sizes, int) or [args.chunk_size or None]
    found = candidates(args.instances, split(args.prefill_fractions, float),
                       split(args.policies), split(args.flip_policies) or [args.flip_policy],
                       chunks, split(args.admissions) or [args.decode_admission])
    if not found:
        raise ConfigError("no candidate: give --prefill-fractions or --policies")
    return found


def pools_path(args: argparse.Namespace) -> Path:
    if args.pools:
        return Path(args.pools)
    return STUDY_POOLS if STUDY_POOLS.exists() else Path(args.cache_dir).expanduser() / POOLS_NAME


def workloads(args: argparse.Namespace, seeds: list[int]) -> dict[int, list[SimRequest]]:
    """Seed -> requests. TetriInfer classes are resampled from the class pools (any count, no
    tokenizer); synthetic and sharegpt are built as `splitserve simulate` builds them."""
    if args.workload in class_pools.WORKLOADS:
        pools = class_pools.load_or_build(pools_path(args), args.tokenizer or args.model,
                                          args.cache_dir)
        num = int(args.rate * args.duration) if args.duration else args.num_requests
        return {seed: class_pools.draw(pools, args.workload, num, args.rate, seed)
                for seed in seeds}
    return {seed: simulate_workload(replace_seed(args, seed)) for seed in seeds}


def replace_seed(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    copy = argparse.Namespace(**vars(args))
    copy.seed = seed
    return copy


def run_from_args(args: argparse.Namespace, instance: InstanceConfig,
                  gateway: GatewayConfig) -> int:
    costs = cost_model(args)
    seeds = split(args.seeds, int) or [0]
    slo = Slo(args.slo_ttft, args.slo_tbt, ttft_per_prompt_token_s=args.slo_ttft_per_token)
    requests = workloads(args, seeds)
    base = partial(layout, instance=instance, gateway=gateway, flip_options=gateway.flip_options,
                   fixed={**stack_times(args), **core_sharing(args)})
    rows = []
    for candidate in plan_candidates(args):
        row, _ = evaluate(candidate, costs, requests, [slo], base)
        rows.append(row)
        print(f"{candidate.label}: {row['goodput_per_instance']['mean']:.3f} req/s per "
              f"instance", file=sys.stderr, flush=True)
    result = plan_result(args, seeds, slo, costs.source, rank(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0


def plan_result(args: argparse.Namespace, seeds: list[int], slo: Slo, source: str,
                ranked: list[dict]) -> dict:
    return {"instances": args.instances, "recommended": ranked[0]["candidate"],
            "workload": {"name": args.workload, "rate": args.rate, "duration_s": args.duration,
                         "num_requests": None if args.duration else args.num_requests},
            "seeds": seeds, "slo": asdict(slo), "cost_model": source,
            "machine": core_sharing(args), "candidates": ranked}


def format_table(result: dict) -> str:
    slo = result["slo"]
    ttft = f"TTFT <= {slo['ttft_s']} s" + (f" + {slo['ttft_per_prompt_token_s']} s/token"
                                           if slo["ttft_per_prompt_token_s"] else "")
    lines = [f"recommended for {result['instances']} instances: {result['recommended']}",
             (f"goodput: requests/s per instance meeting {ttft} and p{slo['tbt_percentile']:g} "
              f"TBT <= {slo['tbt_s']} s; seeds {result['seeds']}; cost model: "
              f"{result['cost_model']}"),
             (f"{'candidate':<28}{'goodput':>9}{'min':>8}{'max':>8}{'met':>6}"
              f"{'TTFT p99':>10}{'TBT p99':>9}{'flips':>6}  vs best")]
    for row in result["candidates"]:
        good = row["goodput_per_instance"]
        verdict = "best" if row is result["candidates"][0] else (
            "worse" if row["distinguishable"] else "not distinguishable")
        lines.append(f"{row['candidate']:<28}{good['mean']:>9.3f}{good['min']:>8.3f}"
                     f"{good['max']:>8.3f}{row['slo_attainment']:>6.0%}"
                     f"{row['ttft_p99_s'] * 1e3:>8.0f}ms{row['tbt_p99_s'] * 1e3:>7.0f}ms"
                     f"{row['flips']:>6.1f}  {verdict}")
    return "\n".join(lines)
