"""How fast the simulator runs: simulated seconds per wall second on a large configuration, and
where the time goes (cProfile, summed by package: the serving code's own policy objects in
common / prefill_instance / decode_instance / control_plane, the simulator's glue, the rest).

    python -m simulator.speed --instances 10 --rate 10 --duration 300
    python -m simulator.speed --instances 100 --rate 100 --duration 3600   # the issue's target

The configuration: half prefill, half decode instances (TetriInfer's layout, conditional
disaggregation off so every request is handed over), the H100 + Llama-2-7B cost model from
published figures, SYNTHETIC Poisson traffic (log-normal lengths, median 256 prompt and 128
output tokens). One process, one core: the simulation is single-threaded.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import sys
from dataclasses import replace
from pathlib import Path

from bench.machine import cpu_kind
from common.config import GatewayConfig, RoutingConfig
from simulator.cluster import Layout
from simulator.hardware import hardware_costs
from simulator.run import simulate, without_wall_time
from simulator.workload import synthetic

ROOT = Path(__file__).resolve().parent.parent
SERVING = ("common", "prefill_instance", "decode_instance", "control_plane", "coupled_instance")


def speed_layout(num_instances: int) -> Layout:
    num_prefill = max(num_instances // 2, 1)
    gateway = GatewayConfig(routing=RoutingConfig(local_prefill="off"))
    return Layout(num_prefill=num_prefill, num_decode=max(num_instances - num_prefill, 1),
                  gateway=gateway)


def package_of(filename: str) -> str:
    """'serving:<package>' for the project's serving code, 'simulator', else 'other'."""
    try:
        parts = Path(filename).resolve().relative_to(ROOT).parts
    except ValueError:
        return "other (stdlib, numpy, msgspec)"
    if parts and parts[0] in SERVING:
        return f"serving code: {parts[0]}"
    return "simulator" if parts and parts[0] == "simulator" else "other (stdlib, numpy, msgspec)"


def time_by_package(profile: cProfile.Profile) -> dict[str, float]:
    """Own time (tottime) per package, as fractions of the total."""
    totals: dict[str, float] = {}
    for (filename, _, _), row in pstats.Stats(profile).stats.items():
        key = package_of(filename)
        totals[key] = totals.get(key, 0.0) + row[2]
    whole = sum(totals.values()) or 1.0
    return {k: round(v / whole, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def top_functions(profile: cProfile.Profile, count: int = 12) -> list[str]:
    rows = sorted(pstats.Stats(profile).stats.items(), key=lambda kv: -kv[1][2])[:count]
    return [f"{row[2]:7.2f} s own  {Path(f).name}:{line} {name}"
            for (f, line, name), row in rows]


def _run(num_instances: int, requests: list, seed: int, steady_decode: bool,
         profile: cProfile.Profile | None = None) -> dict:
    layout = replace(speed_layout(num_instances), steady_decode=steady_decode)
    if profile is not None:
        profile.enable()
    report = simulate(layout, hardware_costs("h100-llama2-7b"), requests, seed=seed)
    if profile is not None:
        profile.disable()
    return report


def measure(num_instances: int, rate: float, duration_s: float, seed: int = 0,
            with_profile: bool = False, baseline: bool = False) -> dict:
    requests = synthetic(int(rate * duration_s), rate, seed)
    profile = cProfile.Profile() if with_profile else None
    report = _run(num_instances, requests, seed, True, profile)
    sim = report["simulation"]
    result = {
        "instances": num_instances, "rate": rate, "traffic_s": duration_s,
        "requests": len(requests), "output_tokens": report["total_output_tokens"],
        "simulated_s": sim["simulated_s"], "wall_s": sim["wall_s"], "cpu_s": sim["cpu_s"],
        "simulated_s_per_wall_s": sim["simulated_s_per_wall_s"],
        "cpu_us_per_output_token": 1e6 * sim["cpu_s"] / max(report["total_output_tokens"], 1),
        "events": sim["events"], "forwards": sim["forwards"], "num_ok": report["num_ok"],
        "machine": platform.processor() or platform.machine(), "cpu": cpu_kind(),
        "profiled": with_profile}
    if baseline:  # the same requests with every forward planned by the scheduler
        slow = _run(num_instances, requests, seed, False)
        result["baseline_planned_every_forward"] = {
            "cpu_s": slow["simulation"]["cpu_s"], "events": slow["simulation"]["events"],
            "cpu_us_per_output_token": 1e6 * slow["simulation"]["cpu_s"]
            / max(slow["total_output_tokens"], 1),
            "same_report": (without_wall_time(report, "events")
                            == without_wall_time(slow, "events"))}
        result["speedup_cpu"] = slow["simulation"]["cpu_s"] / max(sim["cpu_s"], 1e-9)
    if profile is not None:
        result["time_by_package"] = time_by_package(profile)
        result["top_functions"] = top_functions(profile)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.speed", description=__doc__)
    parser.add_argument("--instances", type=int, default=10)
    parser.add_argument("--rate", type=float, default=10.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of traffic")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cprofile", action="store_true",
                        help="profile (slows the run about 2x; the speed is then not the one "
                             "to report)")
    parser.add_argument("--baseline", action="store_true",
                        help="also run the same requests with the steady-decode fast path off "
                             "(every forward planned by the scheduler): its CPU time, the "
                             "speed-up, and whether the two reports agree")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = measure(args.instances, args.rate, args.duration, args.seed, args.cprofile,
                     args.baseline)
    for line in result.pop("top_functions", []):
        print(line)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
