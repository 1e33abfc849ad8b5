"""Validation harness (issue 23): the same workload run for real (`splitserve up` + bench's
client) and simulated with a cost model fitted to this machine's `splitserve profile` record;
the relative error of each metric, against the issue's targets (5% on means and throughput,
15% on p99 TTFT).

    python -m simulator.validate --cases '1P1D:LPLD:low:0' --num-requests 40
    python -m simulator.validate --cases '*' --dry-run      # the issue's whole matrix

A case is LAYOUT:WORKLOAD:RATE:SEED (fnmatch patterns select from the matrix: 4 layouts x
LPLD/HPLD/Mixed x low/high x seeds 0-2). Layouts: 1P1D and 1P2D with one torch thread per
instance; sarathi and vllm as one co-located instance with two threads (this machine's two
cores). The requests are bench's (bench.workloads.sample_workload at the case's seed, fixed
output lengths with ignore-EOS) with bench's Poisson arrivals; the real run warms up with two
of them first, as `bench compare` does. Rates are fractions of the cluster's idealized
capacity on the fitted model (simulator.study.anchor_rate x 2 cores): low 0.25, high 0.5.

Both sides read the same profile record: the real instances through a cache directory of
the record's own under --cache-dir (simulator.record_cache: ChunkSize, the local prefill
budget, co-located cost curves), the simulator through the fit. A record measured with a
different thread count than the case's instances is used anyway and flagged
(`profile.threads_match`).
Real timings are disturbed by whatever else runs on the machine: `uptime` before and after is
in each case's JSON, beside per-request TTFT and JCT of both sides. The real instances write
forward logs (`splitserve up --forward-log`), read into each case's `forward_classes`
(simulator.forward_check), its held-out calibration (simulator.calibrate) and its replay at
its own run's speed (`own_speed`); a request-path probe precedes each load
(simulator.request_path), speed probes precede and follow it (simulator.speed_probe).
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import functools
import itertools
import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from common.config import ConfigError, InstanceConfig
from simulator.calibrate import (calibrate_case, case_lines, charges, own_speed, run_logs,
                                 scaled, simulate_with)
from simulator.costs import CostModel
from simulator import previous_run, request_path, speed_probe
from simulator.fit import fit_profile
from simulator.forward_check import (forward_classes, forward_time, loop_counters,
                                      measured_overhead)
from simulator.record_cache import record_cache_dir

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs/benchmarks/simulator_validation"
LAYOUTS = {  # name -> (`splitserve up` flags the simulator also takes, torch threads each)
    "1P1D": (("--prefill", "1", "--decode", "1"), 1),
    "1P2D": (("--prefill", "1", "--decode", "2"), 1),
    "sarathi": (("--prefill", "0", "--decode", "0", "--coupled", "1", "--policy", "sarathi"), 2),
    "vllm": (("--prefill", "0", "--decode", "0", "--coupled", "1", "--policy", "vllm"), 2),
}
WORKLOADS = ("LPLD", "HPLD", "Mixed")
WARM_UP_PROMPT = "Warm-up request: reply with one word."  # in no workload: nothing cached
RATES = {"low": 0.25, "high": 0.5}  # x the cluster's idealized capacity (module docstring)
CORES = 2
SEEDS = (0, 1, 2)
SAMPLED = {"temperature": 0.7, "top_p": 0.95}  # what most users send (--sampled)
METRICS = {  # name -> (path in bench's summary, target relative error)
    "ttft_mean": (("ttft_s", "mean"), 0.05), "ttft_p99": (("ttft_s", "p99"), 0.15),
    "tpot_mean": (("tpot_s", "mean"), 0.05), "jct_mean": (("jct_s", "mean"), 0.05),
    "throughput_tokens": (("throughput", "output_tokens_per_s"), 0.05),
}


@dataclass(frozen=True)
class Case:
    layout: str
    workload: str
    rate: str
    seed: int
    sampled: bool = False  # the real requests sample (SAMPLED) instead of greedy

    @property
    def name(self) -> str:
        return f"{self.layout}-{self.workload}-{self.rate}-s{self.seed}" + \
            ("-sampled" if self.sampled else "")


def select(patterns: str) -> list[Case]:
    """The matrix's cases matching any comma-separated LAYOUT:WORKLOAD:RATE:SEED pattern."""
    matrix = [Case(*c) for c in itertools.product(LAYOUTS, WORKLOADS, RATES, SEEDS)]
    chosen = []
    for pattern in patterns.split(","):
        fields = pattern.strip().split(":") + ["*"] * 3
        if pattern.strip() == "*":
            fields = ["*"] * 4
        chosen += [c for c in matrix if c not in chosen and all(
            fnmatch.fnmatchcase(str(v), p) for v, p in zip(asdict(c).values(), fields[:4]))]
    if not chosen:
        raise ConfigError(f"no case matches {patterns!r}; layouts {list(LAYOUTS)}, workloads "
                          f"{list(WORKLOADS)}, rates {list(RATES)}, seeds {list(SEEDS)}")
    return chosen


def load_profiles(paths: list[str]) -> list[tuple[str, dict]]:
    records = []
    for path in paths:
        try:
            records.append((path, json.loads(Path(path).expanduser().read_text())))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"no profile record at {path} ({exc}): run `splitserve profile "
                              "--threads N --cache-dir DIR` first") from None
    return records


def profile_for(records: list[tuple[str, dict]], threads: int) -> tuple[CostModel, dict]:
    """The fitted model of the record measured with `threads` threads, else of the first."""
    path, record = next(((p, r) for p, r in records if r.get("threads") == threads), records[0])
    costs = fit_profile(record, source=str(path))
    return costs, {"path": str(path), "threads": record.get("threads"),
                   "threads_match": record.get("threads") == threads,
                   "model": record.get("model"), "dtype": record.get("dtype"),
                   "recommended_chunk_size": record.get("recommended_chunk_size"),
                   "fit_max_abs_relative_error": costs.fit.get("max_abs_relative_error")}


def capacity(workload: str, costs: CostModel) -> float:
    """The machine's idealized capacity for `workload` on `costs` (simulator.study.anchor_rate
    x its cores), in requests per second: the scale the cases' rates are fractions of."""
    from simulator import pools
    from simulator.plan_cli import STUDY_POOLS
    from simulator.study import anchor_rate, workload_pairs

    pairs = workload_pairs(pools.load(STUDY_POOLS), workload)
    return anchor_rate(costs, pairs, InstanceConfig().engine.batch.max_num_seqs) * CORES


def case_rate(case: Case, costs: CostModel) -> float:
    return RATES[case.rate] * capacity(case.workload, costs)


def bench_requests(case: Case, num: int, rate: float) -> tuple[list, list[float]]:
    return workload_requests(case.workload, num, rate, case.seed)


def workload_requests(workload: str, num: int, rate: float,
                      seed: int) -> tuple[list, list[float]]:
    """bench's requests of a TetriInfer class at `seed` and their Poisson arrival offsets."""
    from bench.workload import poisson_arrivals
    from bench.workloads import sample_workload

    requests = sample_workload(bench_tokenizer(), workload, num, seed)
    return requests, poisson_arrivals(len(requests), rate, seed)


@functools.cache
def bench_tokenizer():
    """The tokenizer bench counts the workloads' prompts with (the default model's)."""
    from bench.run import BenchOptions, load_tokenizer

    return load_tokenizer(BenchOptions())


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def real_run(case: Case, requests: list, arrivals: list[float], cache_dir: str,
             log_dir: Path, record: str) -> dict:
    """The case for real, its instances reading the profile record at `record` (the one the
    simulated side fits: simulator.record_cache)."""
    flags, threads = LAYOUTS[case.layout]
    return run_for_real(case.name, list(flags), threads, requests, arrivals,
                        record_cache_dir(cache_dir, record), log_dir,
                        SAMPLED if case.sampled else {})[0]


def run_for_real(name: str, flags: list[str], threads: int, requests: list,
                 arrivals: list[float], cache_dir: str, log_dir: Path,
                 sampling: dict | None = None) -> tuple[dict, list]:
    """`splitserve up FLAGS`, two warm-up requests, then the load: the run's summary and
    per-request figures, and bench's records (token times included). The warm-ups are the first
    two requests' output budgets on a prompt of their own: the simulated runs start with empty
    prefix caches, so the real ones must not find the load's first prompts cached. `sampling`:
    the load's and warm-ups' temperature and top_p (none: greedy); the simulator prices a
    sampled row the same either way, so a sampled case checks that too."""
    from bench.cluster import ClusterProcess
    from bench.metrics import run_duration, summarize

    forward_log = log_dir / f"{name}-forwards"  # each instance's forward log (a diagnostic)
    args = [*flags, "--threads-per-instance", str(threads), "--cache-dir", cache_dir,
            "--forward-log", str(forward_log)]
    before = uptime()
    cluster = ClusterProcess(args, log_dir / f"{name}.log")
    try:
        result, records = _load(cluster, requests, arrivals, sampling or {})
    finally:
        cluster.stop()
    summary = summarize(records, run_duration(records))
    per_request = [{"ttft_s": r.ttft, "jct_s": r.jct, "output_tokens": r.output_tokens,
                    "error": r.error} for r in records]
    return {"up_args": args, "summary": summary, "per_request": per_request, **result,
            "forward_log": str(forward_log), "uptime_before": before,
            "uptime_after": uptime()}, records


def _load(cluster, requests: list, arrivals: list[float], sampling: dict) -> tuple[dict, list]:
    """On a started cluster: the warm-ups, the request-path probe, the speed probe, the load,
    the loop counters' growth over it, the speed probe again; bench's records of the load."""
    from bench.client import run_load

    model = cluster.model()
    warm_up = [replace(r, prompt=WARM_UP_PROMPT) for r in requests[:2]]
    asyncio.run(run_load(cluster.url, model, warm_up, [0.0, 0.0], ignore_eos=True,
                         progress=False, **sampling))
    path_probe = request_path.probe(cluster.url, model, requests[0], WARM_UP_PROMPT)
    probes = [speed_probe.probe(cluster.url, model, requests[0], sampling, "before")]
    loop_before = loop_counters(cluster.cluster())
    started, window = time.monotonic(), [time.time()]
    records = asyncio.run(run_load(cluster.url, model, requests, arrivals, ignore_eos=True,
                                   progress=False, **sampling))
    wall = time.monotonic() - started
    window.append(time.time())
    # the last forwards' report reaches the gateway (instances report at the default interval)
    time.sleep(InstanceConfig().report_interval_s * 2)
    loop = {k: v - loop_before[k] for k, v in loop_counters(cluster.cluster()).items()}
    probes.append(speed_probe.probe(cluster.url, model, requests[0], sampling, "after"))
    return {"wall_s": wall, **loop, "load_window": window, "path_probe": path_probe,
            "speed_probes": probes}, records


def sharing(case: Case) -> dict:
    """`from_forwards`' `cores` and `threads` for a layout whose instances want more threads
    than the machine's cores (1P2D: three 1-thread instances on two): their forwards share the
    cores (simulator/cores.py); empty for the others, whose forwards never wait for a core."""
    flags, threads = LAYOUTS[case.layout]
    instances = sum(int(flags[i + 1]) for i, flag in enumerate(flags)
                    if flag in ("--prefill", "--decode", "--coupled"))
    return {"cores": CORES, "threads": threads} if instances * threads > CORES else {}


def simulated_run(case: Case, requests: list, arrivals: list[float], costs: CostModel,
                  cache_dir: str, charges: dict | None = None) -> dict:
    """The same flags through `splitserve simulate`'s parser, the same requests; `charges`:
    Layout fields a calibration sets (simulator.calibrate.CHARGES)."""
    from simulator.run import report, run_cluster
    from simulator.workload import from_bench

    layout = replace(flags_layout(list(LAYOUTS[case.layout][0]), cache_dir),
                     **(charges or {}), record_forwards=True)
    cluster, wall, cpu = run_cluster(layout, costs,
                                     from_bench(requests, arrivals, bench_tokenizer()), case.seed)
    traces = [cluster.traces[f"r{i}"] for i in range(len(requests))]
    per_request = [{"ttft_s": t.token_times[0] - t.request.arrival_s if t.token_times else None,
                    "jct_s": t.finish - t.request.arrival_s, "output_tokens": len(t.token_times),
                    "error": t.error} for t in traces]
    return {"summary": report(cluster, wall, cpu), "per_request": per_request,
            "forwards": [f for i in cluster.instances.values() for f in i.forwards]}


def flags_layout(flags: list[str], cache_dir: str):
    """The simulator's Layout of `splitserve up FLAGS`: the flags through `splitserve
    simulate`'s parser, which builds the configs as `up` does."""
    from control_plane.cli import build_parser
    from control_plane.cli_args import cluster_instance_config, gateway_config
    from simulator.cli import layout_from_args

    args = build_parser().parse_args(["simulate", *flags, "--cache-dir", cache_dir])
    return layout_from_args(args, cluster_instance_config(args), gateway_config(args, 0))


def lookup(summary: dict, path: tuple[str, str]) -> float | None:
    return (summary.get(path[0]) or {}).get(path[1])


def errors(real: dict, simulated: dict) -> dict:
    """Per metric: both values, (simulated - real) / real, the target, and whether it held."""
    result = {}
    for name, (path, target) in METRICS.items():
        r, s = lookup(real, path), lookup(simulated, path)
        error = (s - r) / r if r and s is not None else None
        result[name] = {"real": r, "simulated": s, "relative_error": error, "target": target,
                        "within_target": error is not None and abs(error) <= target}
    return result


def earlier_rate(case: Case, directory: Path | None) -> float | None:
    """The rate an earlier run of the case in `directory` ran at, if there is one."""
    path = directory / f"{case.name}.json" if directory else None
    return json.loads(path.read_text())["rate"] if path is not None and path.is_file() else None


def earlier_real(case: Case, rate: float, num: int, directory: Path | None) -> dict | None:
    """The real side of an earlier run of the same case (same rate and request count), to
    simulate it again under another cost model without running it again."""
    path = directory / f"{case.name}.json" if directory else None
    if path is None or not path.is_file():
        return None
    earlier = json.loads(path.read_text())
    if earlier["num_requests"] != num or not math.isclose(earlier["rate"], rate):
        raise ConfigError(f"{path} ran {earlier['num_requests']} requests at "
                          f"{earlier['rate']:.3f} req/s, not {num} at {rate:.3f}")
    return earlier["real"]


def run_case(case: Case, num: int, profiles: list[tuple[str, dict]], cache_dir: str,
             out: Path, calibration: dict | None = None, real_from: Path | None = None,
             rate_from_real: bool = False, turn_overhead: str = "0",
             compact: bool = False, previous: dict | None = None) -> dict:
    """One case, real and simulated; `calibration` (from `calibrate_case`) scales the model;
    with `real_from`, the real side is that directory's run of the case, if it has one, and
    with `rate_from_real` its rate too (another cost model puts the capacity elsewhere);
    `turn_overhead` seconds per forward, "measured" (the real run's own) or "held-out" (the
    forwards calibration's); `previous`: what the run before it measured
    (simulator.previous_run)."""
    measured, profile = profile_for(profiles, LAYOUTS[case.layout][1])
    rate = (rate_from_real and earlier_rate(case, real_from)) or case_rate(case, measured)
    costs = scaled(measured, calibration) if calibration is not None else measured
    requests, arrivals = bench_requests(case, num, rate)
    real = earlier_real(case, rate, len(requests), real_from) or real_run(
        case, requests, arrivals, cache_dir, out / "logs", profile["path"])
    if turn_overhead == "measured":
        overhead = measured_overhead(real) or 0.0
    elif turn_overhead == "held-out":
        overhead = (calibration or {}).get("turn_overhead_s", 0.0)
    else:
        overhead = float(turn_overhead)
    simulated = simulated_run(case, requests, arrivals, costs, cache_dir,
                              {**charges(calibration or {}), "turn_overhead_s": overhead})
    logs = run_logs(real)  # its forward logs, read once for the diagnostics below
    if calibration is not None:  # what the profile alone gave, beside the calibrated errors
        calibration = {**calibration, "errors_uncalibrated": errors(real["summary"], (
            simulated_run(case, requests, arrivals, measured, cache_dir)["summary"]))}
    result = {"case": asdict(case), "rate": rate, "num_requests": len(requests),
              "profile": profile, "calibration": calibration and {
                  k: v for k, v in calibration.items() if k != "tried"},
              "errors": errors(real["summary"], simulated["summary"]),
              "forward_time": forward_time(real, simulated), "turn_overhead_s": overhead,
              "forward_classes": forward_classes(case_lines(real, logs), simulated.pop("forwards"),
                                                 measured),
              "own_speed": own_speed(case, requests, arrivals, real, logs, measured, cache_dir),
              "speed_tracked": speed_probe.speed_tracked(case, requests, arrivals, real, logs,
                                                         measured, calibration, cache_dir,
                                                         overhead),
              "previous_run": previous and simulate_with(case, requests, arrivals,
                                                         real["summary"], measured, previous,
                                                         cache_dir),
              "requests": [{"prompt_tokens": r.num_prompt_tokens, "max_tokens": r.max_tokens,
                            "arrival_s": a} for r, a in zip(requests, arrivals)],
              "real": real, "simulated": simulated}
    written = result if not compact else {  # a re-simulation of runs kept elsewhere
        **result, "requests": None, "real": {"summary": real["summary"]},
        "simulated": {"summary": simulated["summary"]}}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{case.name}.json").write_text(json.dumps(written, indent=1, default=str) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.validate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1P1D:LPLD:low:0",
                        help="comma-separated LAYOUT:WORKLOAD:RATE:SEED patterns ('*' = all)")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--cache-dir", default="~/.cache/splitserve",
                        help="the real instances' cache (models, the profile record)")
    parser.add_argument("--profile", action="append", default=None, metavar="FILE",
                        help="profile record(s); a case uses the one measured with its thread "
                             "count (default: CACHE_DIR/profile.json)")
    parser.add_argument("--calibration-seed", type=int, default=None,
                        help="before the cases, run each chosen layout/workload/rate once at "
                             "this (held-out) seed and scale the cost model to fit it "
                             "(simulator.calibrate)")
    parser.add_argument("--calibration", choices=("forwards", "forwards-rows", "latencies"),
                        default="forwards",
                        help="with --calibration-seed: 'forwards' measures k (and the loop's "
                             "own seconds per forward) from the held-out run's forward log; "
                             "'forwards-rows' also a per-row in-service cost; "
                             "'latencies' fits k to its mean TTFT, TPOT and JCT")
    parser.add_argument("--real-from", type=Path, default=None, metavar="DIR",
                        help="take a case's real run from DIR/<case>.json when there (e.g. to "
                             "simulate it again calibrated) instead of running it again")
    parser.add_argument("--rate-from-real", action="store_true",
                        help="with --real-from: each case at its earlier run's rate (the same "
                             "run under another cost model, whose capacity, and so whose case "
                             "rate, differs)")
    parser.add_argument("--turn-overhead", default=None, metavar="SECONDS|measured|held-out",
                        help="the simulated instance loop's own seconds per forward; "
                             "'measured': each case's real run's (its turns less its forwards, "
                             "GET /cluster), not fitted; 'held-out': the forwards calibration's "
                             "(default with --calibration forwards, else 0)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--compact", action="store_true",
                        help="case files without the per-request lists (for re-simulations "
                             "of real runs kept elsewhere, --real-from)")
    parser.add_argument("--sampled", action="store_true",
                        help="the real requests (the held-out run's too) sample at temperature "
                             "0.7, top_p 0.95 instead of greedy; case names end in -sampled")
    parser.add_argument("--dry-run", action="store_true", help="list the cases and rates")
    args = parser.parse_args(argv)
    from simulator.validation_table import format_errors

    profiles = load_profiles(args.profile or [str(Path(args.cache_dir) / "profile.json")])
    calibrations: dict[tuple, dict] = {}
    latest: dict[tuple, dict | None] = {}  # per set: what its last real run measured
    turn_overhead = args.turn_overhead or ("held-out" if args.calibration_seed is not None
                                           and args.calibration != "latencies" else "0")
    for case in select(args.cases):
        case = replace(case, sampled=args.sampled)
        if args.dry_run:
            costs, _ = profile_for(profiles, LAYOUTS[case.layout][1])
            print(f"{case.name}: {case_rate(case, costs):.2f} req/s")
            continue
        key = (case.layout, case.workload, case.rate)
        if args.calibration_seed is not None and key not in calibrations:
            if args.calibration_seed in SEEDS:
                raise ConfigError(f"the calibration seed must not be a case seed {SEEDS}")
            calibrations[key] = calibrate_case(Case(*key, args.calibration_seed, args.sampled),
                                               args.num_requests, profiles, args.cache_dir,
                                               args.out, args.calibration, args.real_from)
            print(f"{'-'.join(key)}: forwards scaled by {calibrations[key]['factor']:.3f} "
                  f"(prompt-carrying: {calibrations[key].get('prompt_factor') or 0:.3f}), "
                  f"{calibrations[key]['turn_overhead_s'] * 1e3:.2f} ms loop work per forward "
                  f"(held-out seed {args.calibration_seed})", flush=True)
            latest[key] = previous_run.measurements(
                Case(*key, args.calibration_seed, args.sampled).name, calibrations[key])
        result = run_case(case, args.num_requests, profiles, args.cache_dir, args.out,
                          calibrations.get(key), args.real_from, args.rate_from_real,
                          turn_overhead, args.compact, latest.get(key))
        latest[key] = previous_run.measurements(case.name, result["own_speed"]) or latest.get(key)
        print(format_errors(case, result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
