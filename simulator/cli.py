"""`splitserve simulate`: build the cost model, the layout and the workload from the flags, run
one simulation, write the JSON report and print `splitserve bench`'s summary table.

control_plane/cli.py registers the command with `splitserve up`'s flags plus
simulator.args.add_simulate_args, builds the InstanceConfig and GatewayConfig from them as `up`
does, and calls `run_from_args` (imported in its handler only).
"""

from __future__ import annotations

import argparse
import cProfile
import json
from pathlib import Path

from common.config import ConfigError, GatewayConfig, InstanceConfig
from common.profile_record import PROFILE_RECORD
from simulator import costs as cost_files
from simulator.args import core_sharing, stack_times
from simulator.cluster import Layout
from simulator.costs import CostModel
from simulator.fit import fit_profile
from simulator.hardware import hardware_costs
from simulator.run import Slo, simulate
from simulator.speed import time_by_package, top_functions
from simulator.workload import SimRequest, SyntheticShape, arrivals, from_bench, synthetic



def cost_model(args: argparse.Namespace) -> CostModel:
    """--costs, --profile or --hardware; else this machine's profile record."""
    if args.costs:
        return cost_files.load(args.costs)
    if args.hardware:
        return hardware_costs(args.hardware)
    path = Path(args.profile or Path(args.cache_dir).expanduser() / PROFILE_RECORD).expanduser()
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"no profile to fit at {path} ({exc}): run `splitserve profile`, or "
                          "pass --costs, --profile or --hardware") from None
    return fit_profile(record, kv_bytes=args.kv_bytes_per_token, source=str(path))


def workload(args: argparse.Namespace) -> list[SimRequest]:
    """The requests, as `splitserve bench` would send them (same sampling, same seeds)."""
    num = int(args.rate * args.duration) if args.duration else args.num_requests
    if args.workload == "synthetic":
        shape = SyntheticShape(prompt_median=args.prompt_median, output_median=args.output_median)
        return synthetic(num, args.rate, args.seed, shape, args.arrival, args.cv)
    from bench.run import BenchOptions, build_workload, load_tokenizer

    options = BenchOptions(tokenizer_path=args.tokenizer or args.model, cache_dir=args.cache_dir,
                           num_requests=num, rate=args.rate, arrival=args.arrival, cv=args.cv,
                           max_tokens=args.workload_max_tokens,
                           max_prompt_tokens=args.workload_max_prompt_tokens, seed=args.seed)
    tokenizer = load_tokenizer(options)
    if args.workload == "sharegpt":
        return from_bench(*build_workload(options, tokenizer), tokenizer)
    from bench.workloads import sample_workload

    requests = sample_workload(tokenizer, args.workload, num, args.seed)
    return from_bench(requests, arrivals(len(requests), args.rate, args.seed, args.arrival,
                                         args.cv), tokenizer)


def layout_from_args(args: argparse.Namespace, instance: InstanceConfig,
                     gateway: GatewayConfig) -> Layout:
    return Layout(num_prefill=args.prefill, num_decode=args.decode, num_coupled=args.coupled,
                  instance=instance, gateway=gateway, link=args.link,
                  flip_switch_s=args.flip_switch, **stack_times(args),
                  steady_decode=not args.plan_every_forward, **core_sharing(args))


def run_from_args(args: argparse.Namespace, instance: InstanceConfig,
                  gateway: GatewayConfig) -> int:
    costs = cost_model(args)
    if args.save_costs:
        print(f"cost model written to {costs.save(args.save_costs)}")
    layout = layout_from_args(args, instance, gateway)
    requests = workload(args)
    profile = cProfile.Profile() if args.cprofile else None
    if profile is not None:
        profile.enable()
    slo = Slo(args.slo_ttft, args.slo_tbt, ttft_per_prompt_token_s=args.slo_ttft_per_token)
    report = simulate(layout, costs, requests, args.seed, slo)
    if profile is not None:
        profile.disable()
        report["simulation"]["time_by_package"] = time_by_package(profile)
        print("\n".join(top_functions(profile)))
    report["options"] = {k: v for k, v in vars(args).items() if k != "handler"}
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(format_report(report))
    print(f"wrote {out}")
    return 0


def format_report(report: dict) -> str:
    from bench.run import format_summary  # the table `splitserve bench` prints

    sim, good = report["simulation"], report["goodput"]
    speed = sim["simulated_s_per_wall_s"]
    scaled = good["ttft_per_prompt_token_s"]
    per_token = f" + {scaled} s per prompt token" if scaled else ""
    lines = [format_summary(report),
             (f"goodput: {good['num_met']} of {report['num_requests']} requests within "
              f"TTFT {good['ttft_slo_s']} s{per_token} and p{good['tbt_percentile']:g} TBT "
              f"{good['tbt_slo_s']} s"),
             (f"simulated {sim['simulated_s']:.1f} s in {sim['wall_s']:.1f} s wall "
              f"({speed:.1f} simulated s per wall s), {len(sim['flips'])} flips, "
              f"{sim['preemptions']} preemptions; cost model: {sim['cost_model']}")]
    if sim["kv_check"]["errors"] or sim["kv_check"]["leaked_blocks"]:
        lines.append(f"KV CHECK FAILED: {sim['kv_check']}")
    return "\n".join(lines)
