"""The plan checks simulated again at this VM's speed, measured on one layout and applied to
the other: k per kind and the stack's charges from the forward logs of the real runs of
`--calibrate-on` (all three seeds; simulator.calibrate.from_forwards against the work each
forward did on the two shared cores, the request path and hand-off from its seed-0 run), then
every candidate run for real simulated again with them. For the other candidate the speed is
held out (another layout's runs); for the calibrating one it is its own. Needs the runs' forward
logs (logs/, not in git).

    python docs/benchmarks/simulator_plan_check/zen1-13/calibrated.py FILE.json CANDIDATE \
        [PROFILE CACHE_DIR]      # another session's checks: their profile and cache directory
"""
import json
import statistics
import sys
from dataclasses import replace

from simulator.calibrate import case_lines, charges, from_forwards, path_charges, run_logs, scaled
from simulator.plan import Candidate, run_one
from simulator.plan_check import candidate_flags, sharing_flags
from simulator.run import Slo
from simulator.validate import (bench_tokenizer, flags_layout, load_profiles, profile_for,
                                workload_requests)
from simulator.workload import from_bench

CORES = 2
PROFILE = "docs/benchmarks/simulator_validation/zen1-10/profile-threads1/profile.json"


def measured_speed(real: dict, costs) -> dict:
    runs = real["runs"]
    logs = [run_logs(run) for run in runs]
    lines = [line for run, log in zip(runs, logs) for line in case_lines(run, log)]
    return {**from_forwards(lines, costs, cores=CORES), **path_charges(runs[0], logs[0])}


def main(path: str, calibrate_on: str, profile: str = PROFILE,
         cache_dir: str = "results/vc13") -> None:
    result = json.load(open(path))
    costs, _ = profile_for(load_profiles([profile]), 1)
    real = {r["candidate"]: r for r in result["real"]}
    speed = measured_speed(real[calibrate_on], costs)
    print(f"{result['workload']}: speed from {calibrate_on}'s runs: k decode "
          f"{speed['factor']:.3f}, prompt {speed['prompt_factor']:.3f}, request latency "
          f"{speed.get('request_latency_s') or 0:.3f} s, hand-off "
          f"{speed.get('handoff_s') or 0:.3f} s")
    slo = Slo(result["slo"]["ttft_s"], result["slo"]["tbt_s"])
    requests = {seed: from_bench(*workload_requests(result["workload"],
                                                    result["num_requests"], result["rate"],
                                                    seed), bench_tokenizer())
                for seed in result["seeds"]}
    for name, row in real.items():
        candidate = Candidate(**next(s["layout"] for s in result["simulated"]
                                     if s["candidate"] == name))
        layout = replace(flags_layout(candidate_flags(candidate) + sharing_flags(candidate, CORES),
                                      cache_dir), **charges(speed))
        sim = [run_one(candidate, scaled(costs, speed), requests[seed], seed, [slo],
                       lambda _: layout)["goodput_per_instance"][0] for seed in result["seeds"]]
        got = row["goodput_per_instance"]["per_seed"]
        print(f"  {name:<10} ({'own' if name == calibrate_on else 'held out'}): simulated "
              f"{' / '.join(f'{g:.4f}' for g in sim)} ({statistics.fmean(sim):.4f}), real "
              f"{' / '.join(f'{g:.4f}' for g in got)} ({statistics.fmean(got):.4f}): "
              f"{statistics.fmean(sim) / statistics.fmean(got) - 1:+.0%}")


if __name__ == "__main__":
    main(*sys.argv[1:5])
