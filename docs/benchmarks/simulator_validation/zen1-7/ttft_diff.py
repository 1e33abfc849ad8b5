"""Per-request TTFT, real minus simulated (the held-out-calibrated simulation), per case file:
python docs/benchmarks/simulator_validation/zen1-7/ttft_diff.py CASE.json..."""
import json
import statistics as st
import sys
from pathlib import Path

print("# per-request TTFT, real minus simulated (the held-out-calibrated simulation), seconds")
for path in sys.argv[1:]:
    case = json.loads(Path(path).read_text())
    real = [r["ttft_s"] for r in case["real"]["per_request"]]
    sim = [r["ttft_s"] for r in case["simulated"]["per_request"]]
    diff = sorted(a - b for a, b in zip(real, sim, strict=True))
    later = sum(1 for x in diff if x > 0)
    print(f"{Path(path).stem} real mean {st.mean(real):.3f} sim {st.mean(sim):.3f} | "
          f"real-sim median {st.median(diff):+.3f} p10 {diff[len(diff) // 10]:+.3f} p90 "
          f"{diff[9 * len(diff) // 10]:+.3f}; {later} of {len(diff)} later for real")
