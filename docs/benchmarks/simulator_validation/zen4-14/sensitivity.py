"""How far a case's errors move when the machine's speed is off by a little: each case simulated
at its own run's measured speed (`own_speed`: k per kind and the charges) and again with both
k moved by -5%, -2%, +2% and +5%, the TTFT mean, TPOT mean and JCT mean of each against the
real run's. A case whose TTFT moves by many times the change in k cannot meet the 5% target
held out unless the held-out run measured k that much closer than the host's run-to-run drift.

    python docs/benchmarks/simulator_validation/zen4-14/sensitivity.py --cache-dir results/vc14 \\
        CASE.json ...
"""
import argparse
import json
from pathlib import Path

from simulator import validate as v
from simulator.calibrate import simulate_with

MOVES = (0.95, 0.98, 1.0, 1.02, 1.05)
METRICS = ("ttft_mean", "tpot_mean", "jct_mean")


def moved(case_file: dict, costs, cache_dir: str) -> list[dict]:
    case = v.Case(**case_file["case"])
    requests, arrivals = v.bench_requests(case, case_file["num_requests"], case_file["rate"])
    own = case_file["own_speed"]
    rows = []
    for move in MOVES:
        measured = {**own, "factor": own["factor"] * move,
                    "prompt_factor": own["prompt_factor"] * move}
        errors = simulate_with(case, requests, arrivals, case_file["real"]["summary"], costs,
                               measured, cache_dir)["errors"]
        rows.append({"move": move, **{m: errors[m]["relative_error"] for m in METRICS}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("cases", nargs="+", type=Path)
    args = parser.parse_args()
    fitted = {}
    for path in args.cases:
        case_file = json.loads(path.read_text())
        record = case_file["profile"]["path"]
        threads = v.LAYOUTS[case_file["case"]["layout"]][1]
        if (record, threads) not in fitted:
            fitted[record, threads] = v.profile_for(v.load_profiles([record]), threads)[0]
        rows = moved(case_file, fitted[record, threads], args.cache_dir)
        print(f"{path.stem}: k x " + "  ".join(
            f"{r['move']:.2f}: " + " / ".join(f"{r[m]:+.1%}" for m in METRICS) for r in rows))


if __name__ == "__main__":
    main()
