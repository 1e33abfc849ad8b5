"""Does a forward run slower while more requests are in flight? Per real load of this session:
each forward's measured / modelled seconds (priced by the 1-thread profile; forwards the loop
woke up for left out), grouped by how many requests were open (arrived, not finished) when it
ended, decode steps and prompt-carrying forwards apart. If the front end (client, gateway,
their streams) took CPU from the instances in bursts, the ratio would rise with the open
requests. Grouped again by how many instances were in a forward at the same time (itself included,
time-weighted over its forward, rounded): with more instance processes than cores, a forward
shares its core. Needs the runs' forward logs (logs/, not in git).

    python docs/benchmarks/simulator_validation/zen2-12/contention.py CASE.json ...

Priced with this directory's profile, or with `--profile FILE` first (another session's cases).
"""
import bisect
import json
import sys
from pathlib import Path

from common.engine.forward_log import WAITED_S
from simulator.calibrate import run_logs
from simulator.validate import load_profiles, profile_for

X = Path(__file__).parent
EDGES = (0, 2, 4, 8, 16, 32)  # open requests: [0,2) [2,4) ... [32, inf)
BUSY_EDGES = (1, 2, 3)  # instances in a forward at once, this one included


def open_counts(case: dict):
    """A function of wall time: the number of requests open then."""
    t0 = case["real"]["load_window"][0]
    starts, ends = [], []
    for req, res in zip(case["requests"], case["real"]["per_request"]):
        if res.get("jct_s") is None:
            continue
        starts.append(t0 + req["arrival_s"])
        ends.append(t0 + req["arrival_s"] + res["jct_s"])
    starts.sort()
    ends.sort()
    return lambda t: bisect.bisect_right(starts, t) - bisect.bisect_right(ends, t)


def bucket(n: int, edges=EDGES) -> int:
    return bisect.bisect_right(edges, n) - 1


def busy_counts(logs: dict[str, list[dict]], start: float, end: float):
    """A function of a line: 1 + the time-weighted mean number of other instances in a forward
    during its forward, rounded."""
    spans = {name: sorted((line["time"] - line["forward_s"], line["time"]) for line in lines
                          if start - 60 <= line["time"] <= end + 60)
             for name, lines in logs.items()}
    owner = {id(line): name for name, lines in logs.items() for line in lines}

    def count(line: dict) -> int:
        a, b = line["time"] - line["forward_s"], line["time"]
        overlap = 0.0
        for name, intervals in spans.items():
            if name == owner[id(line)]:
                continue
            i = max(bisect.bisect_left(intervals, (a, a)) - 1, 0)
            while i < len(intervals) and intervals[i][0] < b:
                overlap += max(0.0, min(b, intervals[i][1]) - max(a, intervals[i][0]))
                i += 1
        return 1 + round(overlap / max(b - a, 1e-9))
    return count


def table(lines: list[dict], costs, count, edges=EDGES) -> list[str]:
    sums: dict[tuple[str, int], list[float]] = {}
    for line in lines:
        if line.get("gap_s", 0.0) > WAITED_S:
            continue
        kind = "decode" if line["shape"].kind == "decode" else "prompt"
        cell = sums.setdefault((kind, bucket(count(line), edges)), [0.0, 0.0, 0])
        cell[0] += line["forward_s"]
        cell[1] += costs.shape_s(line["shape"])
        cell[2] += 1
    rows = []
    for kind in ("decode", "prompt"):
        cells = []
        for b, low in enumerate(edges):
            s = sums.get((kind, b))
            cells.append(f"{low}+: {s[0] / s[1]:.2f} ({s[2]})" if s and s[1] else f"{low}+: -")
        rows.append(f"  {kind:6} " + "  ".join(cells))
    return rows


def main() -> None:
    args = sys.argv[1:]
    profile = str(X / "profile-threads1/profile.json")
    if args[:1] == ["--profile"]:
        profile, args = args[1], args[2:]
    costs, _ = profile_for(load_profiles([profile]), 1)
    for path in map(Path, args):
        case = json.loads(path.read_text())
        logs = run_logs(case["real"])
        if logs is None:
            continue
        start, end = case["real"]["load_window"]
        lines = [line for of_one in logs.values() for line in of_one
                 if start <= line["time"] <= end]
        print(f"{path.stem}: measured / modelled by open requests (forwards)")
        by_open = open_counts(case)
        print("\n".join(table(lines, costs, lambda line: by_open(line["time"]))))
        print(f"{path.stem}: measured / modelled by instances in a forward at once (forwards)")
        print("\n".join(table(lines, costs, busy_counts(logs, start, end), BUSY_EDGES)))


if __name__ == "__main__":
    main()
