"""Each validation case calibrated on the real run just before it (issue 23).

The held-out calibration (simulator.calibrate) runs once per layout, workload and rate, at a seed
no case uses, before the three cases; on a shared host the machine's speed drifts by more than
the targets between that run and the last case (2026-12-02's Zen 1: a held-out k of 1.35/1.73
against its cases' own 1.06-1.16/1.13-1.22). The run just before a case is as much held out (other
requests, an earlier time, nothing of the case's own run) and minutes closer: for the first case
it is the held-out calibration run, for each later one the case before it, whose own run's
measurements (`own_speed`: k per kind, loop work, request path, wake-up, hand-off) the
validation has already taken. A case's `previous_run` is the case simulated with those.

    python -m simulator.previous_run DIR [DIR ...] --cache-dir DIR

simulates every case of earlier validation directories again that way (their case files keep
each run's `own_speed` measurements; no forward log is needed), ordering each set's runs by
when their loads started; also with the set's held-out calibration and with each case's own
run's measurements (today's simulator on every side, so they compare evenly), and writes
DIR/previous-run.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from simulator.calibrate import CHARGES, simulate_with

MEASURED = ("factor", "prompt_factor", *CHARGES)  # what a later case is simulated with


def measurements(source: str, measured: dict | None) -> dict | None:
    """What a run measured that a later case is simulated with (a calibration's or a case's
    `own_speed`), named after the run; None when it measured nothing."""
    if not measured or "factor" not in measured:
        return None
    return {"source": source, **{name: measured[name] for name in MEASURED if name in measured}}


def run_order(results: list[dict]) -> list[dict]:
    """Case files of one set in the order their loads ran (`real.load_window`)."""
    return sorted(results, key=lambda r: r["real"]["load_window"][0])


def chain(calibration: dict | None, cases: list[dict]) -> list[tuple[dict, dict | None]]:
    """Each case (in run order) with the measurements of the run before it: the held-out
    calibration's for the first, the previous case's own run's for the others (the last one
    that measured something, where a case's run has no forward log)."""
    previous = measurements(calibration["case_name"], calibration) if calibration else None
    paired = []
    for case in cases:
        paired.append((case, previous))
        previous = measurements(case["case_name"], case.get("own_speed")) or previous
    return paired


def sets(directory: Path) -> dict[tuple, tuple[dict | None, list[dict]]]:
    """A validation directory's case files by (layout, workload, rate, sampled): the set's
    calibration file, if any, and its cases in run order (each with its `case_name`)."""
    from simulator.validation_table import case_files

    grouped: dict[tuple, list[dict]] = {}
    for path in case_files(directory):
        result = {**json.loads(path.read_text()), "case_name": path.stem}
        if (result.get("real") or {}).get("load_window"):  # else a compact re-simulation
            grouped.setdefault(set_of(result), []).append(result)
    calibrations = {}
    for path in sorted(directory.glob("calibration-*.json")):
        calibration = json.loads(path.read_text())
        calibrations.setdefault(set_of(calibration), {
            **calibration, "case_name": path.stem.removeprefix("calibration-")})
    return {key: (calibrations.get(key), run_order(cases)) for key, cases in grouped.items()}


def set_of(result: dict) -> tuple:
    """(layout, workload, rate, sampled) of a case file or a calibration file."""
    c = result["case"]
    return c["layout"], c["workload"], c["rate"], c.get("sampled", False)


def resimulate(directory: Path, cache_dir: str) -> dict[str, dict]:
    """Every case of `directory` simulated with the run before it's measurements, with its set's
    held-out calibration's and with its own run's (`own_speed`, not held out), all with today's
    simulator, so they compare evenly (the case files' errors came from the simulator of their
    day)."""
    from simulator import validate as v

    rows, fitted = {}, {}
    for calibration, cases in sets(directory).values():
        held_out = measurements(calibration["case_name"], calibration) if calibration else None
        for result, previous in chain(calibration, cases):
            case = v.Case(**result["case"])
            path, threads = result["profile"]["path"], v.LAYOUTS[case.layout][1]
            if (path, threads) not in fitted:  # one fit per record, not per case
                fitted[path, threads] = v.profile_for(v.load_profiles([path]), threads)[0]
            requests, arrivals = v.bench_requests(case, result["num_requests"], result["rate"])
            real = result["real"]["summary"]
            own = measurements(result["case_name"], result.get("own_speed"))
            rows[result["case_name"]] = {
                side: measured and simulate_with(case, requests, arrivals, real,
                                                 fitted[path, threads], measured, cache_dir)
                for side, measured in (("held_out", held_out), ("run_before", previous),
                                       ("own_speed", own))}
    return rows


def tally(rows: dict[str, dict]) -> str:
    """Per side, how many cases meet all five targets and the TTFT mean's."""
    from simulator.validation_table import target_counts

    parts = []
    for side in ("held_out", "run_before", "own_speed"):
        found = [r[side]["errors"] for r in rows.values() if r.get(side)]
        five, ttft, _ = target_counts(found) if found else (0, 0, 0.0)
        parts.append(f"{side.replace('_', ' ')}: all five {five}/{len(found)}, TTFT mean "
                     f"{ttft}/{len(found)}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.previous_run",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("directories", nargs="+", type=Path)
    parser.add_argument("--cache-dir", default="~/.cache/splitserve",
                        help="the simulated instances' cache (as the validation's)")
    args = parser.parse_args(argv)
    for directory in args.directories:
        rows = resimulate(directory, args.cache_dir)
        (directory / "previous-run.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(f"{directory}: {len(rows)} cases ({tally(rows)}) -> "
              f"{directory / 'previous-run.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
