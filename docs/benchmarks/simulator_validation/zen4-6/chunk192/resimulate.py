"""The sixth session's Zen 4 runs whose real prefill instances ran another ChunkSize than the
simulated ones, simulated again with the one they ran (no real run again; 2026-11-29).

The real instances read the shared cache's profile record, which the minimum-time profile
(profile-min-threads1, ChunkSize 192) had replaced before these runs, while the simulator fitted
profile-threads1 (ChunkSize 64): the forward logs' classes show real prompt chunks of 129-512
tokens against simulated ones of 33-128, and the prompts' chunk counts match 192. Both records
give the same local prefill budget (64 tokens within the 0.1 s TBT bound), so only the ChunkSize
differs. Each case is simulated on the same fit as before (profile-threads1), with the charges
stored in its files (the held-out calibration's; its own run's, measured from its forward log),
first with ChunkSize 64 (which must give the stored errors again: a check of this replay) and
then with 192. The forward logs are not kept, so nothing is measured again.

    python docs/benchmarks/simulator_validation/zen4-6/chunk192/resimulate.py > table.md
"""
import json
import sys
from pathlib import Path

from simulator import validate as v
from simulator.calibrate import charges, scaled

HERE = Path(__file__).resolve().parent
RUNS = HERE.parent
SETS = [("1P1D", "HPLD", "low"), ("1P1D", "HPLD", "high"), ("1P1D", "Mixed", "high"),
        ("1P2D", "HPLD", "low"), ("1P2D", "Mixed", "low")]


def simulate(case, requests, arrivals, costs, stored: dict | None, chunk: int) -> dict:
    flags, threads = v.LAYOUTS[case.layout]
    v.LAYOUTS[case.layout] = ((*flags, "--chunk-size", str(chunk)), threads)
    try:
        model = scaled(costs, stored) if stored else costs
        return v.simulated_run(case, requests, arrivals, model, "results/unused",
                               charges(stored) if stored else None)["summary"]
    finally:
        v.LAYOUTS[case.layout] = (flags, threads)


def row(name: str, errors: dict) -> str:
    cells = [f"{errors[m]['relative_error']:+.1%}" + (" *" if not errors[m]["within_target"]
                                                      else "") for m in v.METRICS]
    return f"| {name} | " + " | ".join(cells) + " |"


def main(directory: Path, suffix: str = "") -> None:
    costs, _ = v.profile_for(v.load_profiles([str(RUNS / "profile-threads1/profile.json")]), 1)
    print("| case | " + " | ".join(v.METRICS) + " |")
    print("|---|" + "---|" * len(v.METRICS))
    for layout, workload, rate in SETS:
        for seed in v.SEEDS:
            case = v.Case(layout, workload, rate, seed, sampled=bool(suffix))
            path = directory / f"{case.name}.json"
            if not path.is_file():
                continue
            stored = json.loads(path.read_text())
            held_out = stored["calibration"]
            own = {k: x for k, x in stored["own_speed"].items() if k != "errors"}
            requests, arrivals = v.bench_requests(case, stored["num_requests"], stored["rate"])
            assert [r.num_prompt_tokens for r in requests] == \
                [r["prompt_tokens"] for r in stored["requests"]], case.name
            real = stored["real"]["summary"]
            for label, charged, before in (
                    ("profile alone", None, held_out["errors_uncalibrated"]),
                    ("held out", held_out, stored["errors"]),
                    ("own run's speed", own, stored["own_speed"]["errors"])):
                again = v.errors(real, simulate(case, requests, arrivals, costs, charged, 64))
                same = all(abs((again[m]["relative_error"] or 0)
                               - (before[m]["relative_error"] or 0)) < 1e-9 for m in v.METRICS)
                fixed = v.errors(real, simulate(case, requests, arrivals, costs, charged, 192))
                print(row(f"{case.name}, {label}, ChunkSize 192"
                          + ("" if same else " (the 64 replay differs from the stored errors)"),
                          fixed), flush=True)


if __name__ == "__main__":
    main(RUNS / sys.argv[1] if len(sys.argv) > 1 else RUNS,
         sys.argv[2] if len(sys.argv) > 2 else "")
