"""Rows of docs/simulator.md's ninth-session table: each case's errors held out and at its own
speed, from the first-text runs ($X/first-text/) and the first-token runs ($X/).

    python docs/benchmarks/simulator_validation/zen3-9/table.py
"""
import json
import sys
from pathlib import Path

X = Path(__file__).parent
KEYS = ("ttft_mean", "ttft_p99", "tpot_mean", "jct_mean", "throughput_tokens")


def cells(errors: dict) -> str:
    return " / ".join(f"{errors[k]['relative_error'] * 100:+.1f}%"
                      + ("" if errors[k]["within_target"] else " *") for k in KEYS)


def rows(directory: Path, label: str):
    for path in sorted(directory.glob("*-s[0-2].json")):
        case = json.loads(path.read_text())
        yield (f"| {path.stem} | {case['rate']:.2f} | {label} | {cells(case['errors'])} | "
               f"{cells(case['own_speed']['errors'])} |")


def main() -> None:
    for line in sorted([*rows(X / "first-text", "first text"), *rows(X, "first token")],
                       key=lambda row: row.split("|")[1]):
        print(line)
    counts = {}
    for directory, label in ((X / "first-text", "first text"), (X, "first token")):
        for path in sorted(directory.glob("*-s[0-2].json")):
            case = json.loads(path.read_text())
            for side, errors in (("held out", case["errors"]),
                                 ("own speed", case["own_speed"]["errors"])):
                key = (label, side)
                met = all(errors[k]["within_target"] for k in KEYS)
                total, good = counts.get(key, (0, 0))
                counts[key] = (total + 1, good + met)
    for (label, side), (total, good) in counts.items():
        print(f"{label}, {side}: all five in {good} of {total}", file=sys.stderr)


if __name__ == "__main__":
    main()
