"""Where the disaggregated cases' TPOT is lost: per case, the requests with 2-5 output tokens
(whose TPOT is mostly the KV hand-off) and the longer ones, real against simulated, and the
hand-offs read off the real run's forward logs (simulator.request_path), as residuals from the
held-out calibration's line: their mean, median and largest. Needs the forward logs (kept
under logs/, not committed).

    python docs/benchmarks/simulator_validation/zen4-8/short_outputs.py CASE.json... \\
        > short_outputs.txt
"""
import json
import statistics
import sys
from pathlib import Path

from simulator import request_path
from simulator.calibrate import run_logs


def tpot(request: dict) -> float:
    return (request["jct_s"] - request["ttft_s"]) / (request["output_tokens"] - 1)


def by_length(case: dict) -> list[str]:
    lines = []
    real, simulated = case["real"]["per_request"], case["simulated"]["per_request"]
    for low, high in ((2, 5), (6, None)):
        pairs = [(tpot(r), tpot(s)) for r, s in zip(real, simulated)
                 if r["output_tokens"] >= low and (high is None or r["output_tokens"] <= high)]
        if pairs:
            lines.append(f"  outputs {low}-{high or 'more'}: {len(pairs)} requests, TPOT mean "
                         f"real {statistics.mean(a for a, _ in pairs) * 1e3:.1f} ms, simulated "
                         f"{statistics.mean(b for _, b in pairs) * 1e3:.1f}; median real "
                         f"{statistics.median(a for a, _ in pairs) * 1e3:.1f}, simulated "
                         f"{statistics.median(b for _, b in pairs) * 1e3:.1f}")
    return lines


def handoffs(case: dict) -> str:
    logs = run_logs(case["real"])
    if logs is None:
        return "  no forward log"
    pairs = request_path._handoff_pairs(logs, tuple(case["real"]["load_window"]))
    held_out = case.get("calibration") or {}
    fixed, per_token = held_out.get("handoff_s") or 0.0, held_out.get("handoff_per_token_s") or 0.0
    excess = sorted(seconds - fixed - per_token * tokens for tokens, seconds in pairs)
    if not excess:
        return "  no hand-off paired"
    return (f"  {len(pairs)} hand-offs paired; beyond the held-out line: mean "
            f"{statistics.mean(excess) * 1e3:.1f} ms, median {statistics.median(excess) * 1e3:.1f}"
            f", largest {excess[-1] * 1e3:.0f} ms")


def main(paths: list[str]) -> None:
    for path in paths:
        case = json.loads(Path(path).read_text())
        print(Path(path).name)
        print("\n".join(by_length(case) + [handoffs(case)]))


if __name__ == "__main__":
    main(sys.argv[1:])
