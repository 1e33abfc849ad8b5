"""Where a request's time to first token goes, real and simulated: the wait before the forward
that carried its prompt (the way in, and the forwards ahead of it), that forward, and the way
back (from the forward's end to the client's first token). Real side: the case's forward logs
(arrival = load window start + the request's offset); simulated: the case simulated again with
its held-out calibration, each forward's start recorded. Prompts are matched to the first
forward after their arrival holding a fresh chunk of their length.

    python ttft_split.py CASE.json...     (the forward logs must be on this machine)
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from simulator import instances
from simulator.calibrate import charges, run_logs, scaled
from simulator.validate import Case, bench_requests, load_profiles, profile_for, simulated_run

CACHE_DIR = "results/vz9"  # the validation's shared cache (the simulated layout's flags)


def match(requests, forwards):
    """forwards: (start, seconds, fresh lengths) sorted by start; -> per request (wait,
    forward, end) relative to arrival, or None."""
    used, out = set(), []
    for r in requests:
        hit = next((i for i, (start, _, fresh) in enumerate(forwards)
                    if start >= r["arrival"] - 0.002 and i not in used
                    and r["prompt_tokens"] in fresh), None)
        if hit is None:
            out.append(None)
            continue
        used.add(hit)  # several equal prompts in one forward: matched once each is enough here
        start, seconds, _ = forwards[hit]
        out.append((start - r["arrival"], seconds, start + seconds - r["arrival"]))
    return out


def real_split(case: dict):
    logs = run_logs(case["real"])
    t0 = case["real"]["load_window"][0]
    forwards = sorted((line["time"] - line["forward_s"], line["forward_s"],
                       tuple(line["shape"].fresh)) for lines in logs.values() for line in lines)
    reqs = [{"arrival": t0 + q["arrival_s"], "prompt_tokens": q["prompt_tokens"]}
            for q in case["requests"]]
    return match(reqs, forwards), [p["ttft_s"] for p in case["real"]["per_request"]]


def sim_split(case: dict, profile_paths: list[str], own: bool = False):
    c = Case(**{k: case["case"][k] for k in ("layout", "workload", "rate", "seed", "sampled")})
    measured, _ = profile_for(load_profiles(profile_paths), case["profile"]["threads"])
    calibration = case["own_speed"] if own else case["calibration"]
    costs = scaled(measured, calibration)
    requests, arrivals = bench_requests(c, case["num_requests"], case["rate"])
    starts = []
    cls = instances.SimInstance
    original = cls._forward_done

    def recording(self, plan, seconds):
        overhead = self.cluster.layout.turn_overhead_s
        starts.append((self.loop.now - seconds - overhead, seconds, plan.shape().fresh))
        return original(self, plan, seconds)
    cls._forward_done = recording
    try:
        sim = simulated_run(c, requests, arrivals, costs, CACHE_DIR,
                            {**charges(calibration), "turn_overhead_s":
                             calibration.get("turn_overhead_s", 0.0)})
    finally:
        cls._forward_done = original
    reqs = [{"arrival": a, "prompt_tokens": r.num_prompt_tokens}
            for r, a in zip(requests, arrivals)]
    return match(reqs, sorted(starts)), [p["ttft_s"] for p in sim["per_request"]]


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else float("nan")


def main(paths, profiles, own=False):
    for path in paths:
        case = json.loads(Path(path).read_text())
        real, real_ttft = real_split(case)
        sim, sim_ttft = sim_split(case, profiles, own)
        rows = [(r, s, rt, st) for r, s, rt, st in zip(real, sim, real_ttft, sim_ttft)
                if r is not None and s is not None]
        parts = {
            "wait": ([r[0] for r, *_ in rows], [s[0] for _, s, *_ in rows]),
            "forward": ([r[1] for r, *_ in rows], [s[1] for _, s, *_ in rows]),
            "back": ([rt - r[2] for r, _, rt, _ in rows], [st - s[2] for _, s, _, st in rows]),
            "ttft": ([rt for *_, rt, _ in rows], [st for *_, st in rows]),
        }
        print(f"{Path(path).stem}: {len(rows)} of {len(real)} matched (mean / median, ms; "
              f"real, sim, real-sim)")
        for name, (r, s) in parts.items():
            d = [a - b for a, b in zip(r, s)]
            print(f"  {name:8s} mean {mean(r)*1e3:8.1f} {mean(s)*1e3:8.1f} {mean(d)*1e3:+7.1f} | "
                  f"median {med(r)*1e3:8.1f} {med(s)*1e3:8.1f} {med(d)*1e3:+7.1f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    profiles = [a.split("=", 1)[1] for a in args if a.startswith("--profile=")]
    main([a for a in args if not a.startswith("--")], profiles, "--own" in args)
