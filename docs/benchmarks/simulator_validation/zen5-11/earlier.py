"""Earlier sessions' cases simulated again with this session's simulator (their real runs as
recorded; `python -m simulator.previous_run DIR...` wrote DIR/previous-run.json): per directory
and workload, how many cases meet all five targets and the TTFT mean's at their own run's speed
as recorded (the simulator of their day) and today (prompt token ids shared), and held out and
calibrated on the run before, today.

    python docs/benchmarks/simulator_validation/zen5-11/earlier.py DIR [DIR ...]
"""
import json
import sys
from pathlib import Path

from simulator.validation_table import target_counts


def met(errors: dict | None) -> tuple[int, int]:
    """(meets all five targets, meets the TTFT mean's) of one case's errors, 0/1 each."""
    return target_counts([errors])[:2] if errors else (0, 0)


print("| directory | workload | cases | own speed as recorded: all five / TTFT mean | own speed "
      "today | held out today | run before today |")
print("|---|---|---|---|---|---|---|")
totals: dict[str, list[int]] = {}
for directory in map(Path, sys.argv[1:]):
    today = json.loads((directory / "previous-run.json").read_text())
    by_workload: dict[str, list[list[int]]] = {}
    for name, sides in today.items():
        case = json.loads((directory / f"{name}.json").read_text())
        row = by_workload.setdefault(case["case"]["workload"], [[0, 0] for _ in range(4)] + [[0]])
        row[4][0] += 1
        recorded = (case.get("own_speed") or {}).get("errors")
        for i, errors in enumerate((recorded, *[(sides.get(s) or {}).get("errors")
                                                for s in ("own_speed", "held_out",
                                                          "run_before")])):
            five, ttft = met(errors)
            row[i][0] += five
            row[i][1] += ttft
    for workload, row in sorted(by_workload.items()):
        n = row[4][0]
        cells = [f"{a}/{b}" for a, b in row[:4]]
        label = directory.name if directory.parent.name == "simulator_validation" else \
            f"{directory.parent.name}/{directory.name}"
        print(f"| {label} | {workload} | {n} | " + " | ".join(cells) + " |")
        total = totals.setdefault(workload, [0] * 9)
        total[0] += n
        for i, (a, b) in enumerate(row[:4]):
            total[1 + 2 * i] += a
            total[2 + 2 * i] += b
for workload, t in sorted(totals.items()):
    print(f"| all | {workload} | {t[0]} | " + " | ".join(f"{t[1 + 2 * i]}/{t[2 + 2 * i]}"
                                                         for i in range(4)) + " |")
