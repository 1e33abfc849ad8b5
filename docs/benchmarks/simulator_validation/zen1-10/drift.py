"""The machine's forward speed within each real load of this session, by quarter of the load
window, beside the speed probes before (and after) it: measured / modelled seconds of the decode
steps and of the prompt-carrying forwards (forwards the loop woke up for left out), priced by
the 1-thread profile. Needs the runs' forward logs (logs/, not in git); the output is in
drift.txt.

    python docs/benchmarks/simulator_validation/zen1-10/drift.py CASE.json ...
"""
import json
import sys
from pathlib import Path

from common.engine.forward_log import WAITED_S
from simulator.calibrate import run_logs
from simulator.speed_probe import speeds
from simulator.validate import load_profiles, profile_for

X = Path(__file__).parent
QUARTERS = 4


def ratio(lines: list[dict], costs, kind: str) -> str:
    chosen = [line for line in lines if line.get("gap_s", 0.0) <= WAITED_S
              and (line["shape"].kind == "decode") == (kind == "decode")]
    modelled = sum(costs.shape_s(line["shape"]) for line in chosen)
    return f"{sum(line['forward_s'] for line in chosen) / modelled:.2f}" if modelled else "-"


def main() -> None:
    costs, _ = profile_for(load_profiles([str(X / "profile-threads1/profile.json")]), 1)
    for path in map(Path, sys.argv[1:]):
        real = json.loads(path.read_text())["real"]
        logs = run_logs(real)
        if logs is None:
            continue
        lines = [line for of_one in logs.values() for line in of_one]
        start, end = real["load_window"]
        cells = []
        for i in range(QUARTERS):
            a, b = (start + (end - start) * q / QUARTERS for q in (i, i + 1))
            part = [line for line in lines if a <= line["time"] < b]
            cells.append(f"{ratio(part, costs, 'decode')}/{ratio(part, costs, 'prompt')}")
        probes = [speeds([p], lines, costs) for p in real.get("speed_probes") or []]
        shown = [f"{p['decode']:.2f}/{p['prompt']:.2f}" if p else "-" for p in probes]
        print(f"{path.stem}: load by quarter {' '.join(cells)}; probes before/after "
              f"{' '.join(shown) or '-'} (decode/prompt)")


if __name__ == "__main__":
    main()
