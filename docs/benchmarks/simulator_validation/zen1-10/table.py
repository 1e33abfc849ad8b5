"""Rows of docs/simulator.md's tenth-session table: each case's errors held out, held out moved
by the speed probes' drift, and at its own speed, with the decode-step k of each; then how
often each meets all five targets and the TTFT mean's.

    python docs/benchmarks/simulator_validation/zen1-10/table.py [DIR ...]   (default: this one
    and its sampled/)
"""
import json
import sys
from pathlib import Path

X = Path(__file__).parent
KEYS = ("ttft_mean", "ttft_p99", "tpot_mean", "jct_mean", "throughput_tokens")
SIDES = ("held out", "tracked", "own speed")


def cells(errors: dict) -> str:
    return " / ".join(f"{errors[k]['relative_error'] * 100:+.1f}%"
                      + ("" if errors[k]["within_target"] else " *") for k in KEYS)


def sides(case: dict) -> dict:
    """(k decode/prompt, errors) of each side the case file has."""
    cal, tracked, own = case.get("calibration") or {}, case.get("speed_tracked"), \
        case.get("own_speed")
    found = {"held out": (cal, case["errors"])}
    if tracked:
        found["tracked"] = (tracked, tracked["errors"])
    if own:
        found["own speed"] = (own, own["errors"])
    return found


def k(calibration: dict) -> str:
    return f"{calibration.get('factor', 0):.2f}/{calibration.get('prompt_factor') or 0:.2f}"


def main() -> None:
    directories = [Path(d) for d in sys.argv[1:]] or [X, X / "sampled"]
    counts = {side: [0, 0, 0] for side in SIDES}  # cases, all five, TTFT mean
    print("| case | req/s | " + " | ".join(f"{s}: k, TTFT mean / p99 / TPOT / JCT / throughput"
                                           for s in SIDES) + " |")
    print("|---|---|" + "---|" * len(SIDES))
    for directory in directories:
        for path in sorted(directory.glob("*-s[0-2]*.json")):
            case = json.loads(path.read_text())
            found = sides(case)
            row = [f"k {k(c)}: {cells(e)}" if side in found else "-"
                   for side in SIDES for c, e in [found.get(side, ({}, {}))]]
            print(f"| {path.stem} | {case['rate']:.2f} | " + " | ".join(row) + " |")
            for side, (_, errors) in found.items():
                counts[side][0] += 1
                counts[side][1] += all(errors[key]["within_target"] for key in KEYS)
                counts[side][2] += errors["ttft_mean"]["within_target"]
    for side, (total, five, ttft) in counts.items():
        print(f"{side}: all five in {five} of {total}, TTFT mean within 5% in {ttft} of {total}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
