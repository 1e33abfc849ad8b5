"""The hand-off line with the median residual (handoff-median/, the code the runs ran) against
the mean (handoff-mean/, since 2026-11-29), case by case, both simulated again from the same
real runs; the last lines check that the median replay gives the stored errors again and
count the cases within target.

    python docs/benchmarks/simulator_validation/zen4-8/compare_handoff.py \
        > docs/benchmarks/simulator_validation/zen4-8/handoff_mean_vs_median.txt
"""
import glob
import json
import os

X = "docs/benchmarks/simulator_validation/zen4-8"
METRICS = ["ttft_mean", "ttft_p99", "tpot_mean", "jct_mean", "throughput_tokens"]
ROWS = {"held": lambda case: case["errors"], "own": lambda case: case["own_speed"]["errors"]}


def load(directory: str, name: str) -> dict:
    with open(f"{directory}/{name}") as f:
        return json.load(f)


def error(errors: dict, metric: str) -> float:
    return errors[metric]["relative_error"] or 0.0


def main() -> None:
    totals = {key: [0, 0, 0, 0] for key in ROWS}  # all five median, mean; TPOT median, mean
    same = True
    for sub in ("", "sampled/"):
        for path in sorted(glob.glob(f"{X}/{sub}1P*.json")):
            name = os.path.basename(path)
            stored = load(f"{X}/{sub}", name)
            median = load(f"{X}/handoff-median/{sub}", name)
            mean = load(f"{X}/handoff-mean/{sub}", name)
            for key, get in ROWS.items():
                before, after = get(median), get(mean)
                same &= all(abs(error(get(stored), m) - error(before, m)) < 1e-9
                            for m in METRICS)
                totals[key][0] += all(before[m]["within_target"] for m in METRICS)
                totals[key][1] += all(after[m]["within_target"] for m in METRICS)
                totals[key][2] += before["tpot_mean"]["within_target"]
                totals[key][3] += after["tpot_mean"]["within_target"]
                moves = "  ".join(f"{label} {error(before, m):+.1%} -> {error(after, m):+.1%}"
                                  for label, m in (("TPOT", "tpot_mean"), ("JCT", "jct_mean"),
                                                   ("TTFT", "ttft_mean")))
                print(f"{name[:26]:26} {key:4} {moves}")
    print("replay of median == stored:", same)
    print({key: f"all five {v[0]} -> {v[1]}, TPOT {v[2]} -> {v[3]}" for key, v in totals.items()})


if __name__ == "__main__":
    main()
