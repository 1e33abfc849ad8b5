"""`splitserve plan`'s recommendation checked on this machine (issue 23): the candidates
simulated on bench's requests, then the recommended and the next-best layouts run for real with
the same requests and arrival times, their goodput measured under the same SLOs.

    python -m simulator.plan_check --workload LPLD --load 0.5 --instances 2 \\
        --cache-dir results/vc1 --profile results/vc1/profile.json --seeds 0,1,2

Every candidate is a list of `splitserve up` flags (`candidate_flags`): the simulator builds its
layout from those flags through `splitserve simulate`'s parser (simulator.validate.flags_layout)
and the real run starts `splitserve up` with them, one torch thread per instance. A candidate of
more instances than this machine's cores is simulated on shared cores (as `splitserve plan
--shared-cores` does, simulator/cores.py), as its real run shares them. Goodput per instance as
`splitserve plan` counts it: requests meeting the TTFT and p99 TBT SLOs, per second of the
arrival window, per instance; on the real side from bench's records (bench.metrics.goodput,
the same rule). The ranking on both sides uses simulator.plan.rank's paired rule: one layout
beats another only when it does on every seed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from common.config import ConfigError
from simulator.plan import (FLIP_WATCH, Candidate, arrival_window, candidates, paired_verdict,
                            rank, spread)
from simulator.plan import summary as plan_summary
from simulator.run import Slo

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs/benchmarks/simulator_plan_check"


def candidate_flags(candidate: Candidate) -> list[str]:
    """The `splitserve up` flags of a candidate (the layout `simulator.plan.layout` builds on
    `up`'s defaults with local prefill off)."""
    if candidate.num_coupled:
        flags = ["--prefill", "0", "--decode", "0", "--coupled", str(candidate.num_coupled),
                 "--policy", candidate.policy, "--local-prefill", "off"]
        chunk = ["--max-num-batched-tokens", str(candidate.chunk_size)]
    else:
        flags = ["--prefill", str(candidate.num_prefill), "--decode", str(candidate.num_decode),
                 "--local-prefill", "off", "--decode-admission", candidate.admission,
                 "--flip-policy", candidate.flip_policy]
        if candidate.flip_policy != "none":
            flags += [arg for key, value in FLIP_WATCH for arg in ("--flip-option",
                                                                   f"{key}={value:g}")]
        chunk = ["--chunk-size", str(candidate.chunk_size)]
    return flags + (chunk if candidate.chunk_size else [])


def machine_cores() -> int:
    """The cores the real runs get (this process's CPU affinity)."""
    return len(os.sched_getaffinity(0))


def sharing_flags(candidate: Candidate, cores: int) -> list[str]:
    """`splitserve simulate`'s flags for this machine's cores: a candidate of more 1-thread
    instances than cores shares them (simulator/cores.py), as its real run will."""
    return ["--shared-cores", str(cores)] if candidate.instances > cores else []


def simulate_candidates(found: list[Candidate], costs, simulated: dict, slo: Slo,
                        cache_dir: str, cores: int) -> list[dict]:
    """Each candidate simulated on every seed's requests (`simulated`: seed -> SimRequests)
    on `cores` cores, ranked as `splitserve plan` ranks them."""
    from simulator.plan import run_one
    from simulator.validate import flags_layout

    rows = []
    for candidate in found:
        layout = flags_layout(candidate_flags(candidate) + sharing_flags(candidate, cores),
                              cache_dir)
        runs = [run_one(candidate, costs, requests, seed, [slo], lambda _: layout)
                for seed, requests in simulated.items()]
        rows.append(plan_summary(candidate, runs))
        print(f"simulated {candidate.label}: {rows[-1]['goodput_per_instance']['mean']:.4f} "
              "req/s per instance", file=sys.stderr, flush=True)
    return rank(rows)


def real_goodput(candidate: Candidate, workloads: dict, windows: dict, slo: Slo,
                 cache_dir: str, log_dir: Path, sampling: dict | None = None) -> dict:
    """The candidate run for real once per seed (`workloads`: seed -> (bench requests,
    arrivals); `windows`: seed -> arrival window): goodput per instance and the latencies.
    `sampling`: the requests' temperature and top_p (none: greedy)."""
    from bench.metrics import goodput
    from simulator.validate import run_for_real

    runs = []
    for seed, (requests, arrivals) in workloads.items():
        name = f"{candidate.label.replace(' ', '_')}-s{seed}{'-sampled' if sampling else ''}"
        result, records = run_for_real(name, candidate_flags(candidate), 1, requests,
                                       arrivals, cache_dir, log_dir, sampling)
        met = goodput(records, 0.0, slo.ttft_s, slo.tbt_s, slo.tbt_percentile)
        runs.append({"seed": seed, "goodput_per_instance":
                     met["num_met"] / windows[seed] / candidate.instances,
                     "slo_attainment": met["fraction"], **result})
        print(f"real {name}: {runs[-1]['goodput_per_instance']:.4f} req/s per instance "
              f"({met['num_met']}/{len(records)} met)", file=sys.stderr, flush=True)
    return {"candidate": candidate.label, "goodput_per_instance":
            spread([r["goodput_per_instance"] for r in runs]), "runs": runs}


def verdict(best: dict, other: dict) -> str:
    """'better' when `best` beats `other` on every seed, 'worse' when it loses on every seed,
    else 'not distinguishable' (simulator.plan.paired_verdict)."""
    return {1: "better", -1: "worse", 0: "not distinguishable"}[paired_verdict(
        best["goodput_per_instance"], other["goodput_per_instance"])]


def sampling_of(args: argparse.Namespace) -> dict:
    """The real requests' sampling: `--sampled` sends what most users send
    (simulator.validate.SAMPLED); the simulator prices a sampled row as a greedy one, so a
    sampled check also tests that."""
    from simulator.validate import SAMPLED

    return dict(SAMPLED) if args.sampled else {}


def earlier_run(args: argparse.Namespace) -> dict | None:
    """A check's earlier result (`--real-from`), whose real runs are simulated again under
    another profile; it must describe the same requests and SLOs."""
    if args.real_from is None:
        return None
    earlier = json.loads(args.real_from.read_text())
    asked = {"workload": args.workload, "num_requests": args.num_requests,
             "sampling": sampling_of(args) or None,
             "seeds": [int(s) for s in args.seeds.split(",")], "instances": args.instances,
             "slo": asdict(Slo(args.slo_ttft, args.slo_tbt))}
    differ = [key for key, value in asked.items() if earlier.get(key) != value]
    if differ:
        raise ConfigError(f"{args.real_from} differs in {', '.join(differ)}")
    return earlier


def check(args: argparse.Namespace) -> dict:
    from simulator.record_cache import record_cache_dir
    from simulator.validate import (bench_tokenizer, capacity, load_profiles, profile_for,
                                    workload_requests)
    from simulator.workload import from_bench

    costs, profile = profile_for(load_profiles([args.profile]), 1)
    earlier = earlier_run(args)
    rate = earlier["rate"] if earlier else (
        args.rate or args.load * capacity(args.workload, costs))
    seeds = [int(s) for s in args.seeds.split(",")]
    workloads = {seed: workload_requests(args.workload, args.num_requests, rate, seed)
                 for seed in seeds}
    simulated_requests = {seed: from_bench(*pair, bench_tokenizer())
                          for seed, pair in workloads.items()}
    slo, sampling = Slo(args.slo_ttft, args.slo_tbt), sampling_of(args)
    found = candidates(args.instances, [float(f) for f in args.prefill_fractions.split(",")],
                       args.policies.split(","), chunk_sizes=[None])
    cores = machine_cores()
    simulated = simulate_candidates(found, costs, simulated_requests, slo, args.cache_dir, cores)
    if args.simulate_only:
        return {"workload": args.workload, "rate": rate, "simulated": simulated}
    by_label = {c.label: c for c in found}
    real = earlier["real"] if earlier else [
        real_goodput(by_label[row["candidate"]], workloads, {
            seed: arrival_window(requests) for seed, requests in simulated_requests.items()},
            slo, record_cache_dir(args.cache_dir, args.profile), args.out / "logs", sampling)
        for row in simulated[:2]]
    pair = [next(row for row in simulated if row["candidate"] == r["candidate"]) for r in real]
    return {"workload": args.workload, "rate": rate, "load": None if earlier or args.rate
            else args.load, "num_requests": args.num_requests, "seeds": seeds,
            "instances": args.instances, "cores": cores, "slo": asdict(slo), "profile": profile,
            "sampling": sampling or None,
            "real_from": str(args.real_from) if earlier else None,
            "flags": {c.label: candidate_flags(c) for c in found},
            "simulated": simulated, "real": real,
            "recommended": simulated[0]["candidate"], "next_best": simulated[1]["candidate"],
            "ran_for_real": [r["candidate"] for r in real],
            "simulated_verdict": verdict(*pair), "real_verdict": verdict(*real),
            "agrees": verdict(*pair) == verdict(*real)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.plan_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="LPLD", choices=["LPLD", "LPHD", "HPLD", "HPHD",
                                                               "Mixed"])
    parser.add_argument("--load", type=float, default=0.5,
                        help="rate as a fraction of the machine's idealized capacity "
                             "(simulator.validate.capacity)")
    parser.add_argument("--rate", type=float, default=None, help="req/s (overrides --load)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--prefill-fractions", default="0.5")
    parser.add_argument("--policies", default="sarathi,vllm")
    parser.add_argument("--slo-ttft", type=float, default=1.0)
    parser.add_argument("--slo-tbt", type=float, default=0.2)
    parser.add_argument("--cache-dir", default="~/.cache/splitserve")
    parser.add_argument("--profile", required=True, help="a 1-thread `splitserve profile` "
                                                         "record")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--real-from", type=Path, default=None, metavar="FILE",
                        help="an earlier check's JSON: simulate again (e.g. under another "
                             "profile) against its real runs instead of running them again")
    parser.add_argument("--sampled", action="store_true",
                        help="the real requests sample at temperature 0.7, top_p 0.95 "
                             "instead of greedy; the output file's name ends in -sampled")
    parser.add_argument("--simulate-only", action="store_true",
                        help="print the simulated ranking and stop (nothing runs for real)")
    args = parser.parse_args(argv)
    if args.instances < 2:
        raise ConfigError("a check needs two candidates: --instances >= 2")
    result = check(args)
    if args.simulate_only:
        for row in result["simulated"]:
            print(f"{row['candidate']:<16} {row['goodput_per_instance']['mean']:.4f} req/s per "
                  f"instance, SLOs met {row['slo_attainment']:.0%}, TTFT p99 "
                  f"{row['ttft_p99_s']:.2f} s, TBT p99 {row['tbt_p99_s'] * 1e3:.0f} ms")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-sampled" if args.sampled else ""
    path = args.out / f"{args.workload}-{args.instances}{suffix}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"{args.workload} at {result['rate']:.3f} req/s: recommended {result['recommended']}, "
          f"next {result['next_best']}; of {' vs '.join(result['ran_for_real'])}: simulated "
          f"{result['simulated_verdict']}, real "
          f"{result['real_verdict']}: {'agrees' if result['agrees'] else 'disagrees'} ({path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
