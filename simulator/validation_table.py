"""The validation table of docs/simulator.md from the case files `simulator.validate` wrote,
and the lines `simulator.validate` prints for each case.

    python -m simulator.validation_table DIR [DIR ...]

One row per case file (<case>.json; calibration files are skipped) of each directory, in
directory order: the relative error (simulated - real) / real of each metric against its target,
marked * where it misses, and two diagnostics where the real run recorded them: forward
seconds (simulated against real) and real/model (the real run's forwards, measured against the
cost model's price for the same shapes; from its forward log). A case calibrated on a held-out
run gives two rows: the profile alone, then with the calibration (k, the loop's own work);
a case whose run and held-out run had speed probes one more: the held-out calibration moved by
the machine's drift between them (simulator.speed_probe); one more calibrated on the real run
just before it (simulator.previous_run); a case with a forward log one more: replayed at its own
run's forward speed (not held out).

    python -m simulator.validation_table --counts DIR [DIR ...]

prints instead a markdown table with one row per case (each side's k and errors: held out,
moved by the probes, the run before, own speed) and how many cases meet all five targets and
the TTFT mean's, per side;
a directory's previous-run.json (simulator.previous_run) supplies the run-before side of case
files written before it existed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from simulator.validate import METRICS, Case

HEADERS = {"ttft_mean": "TTFT mean", "ttft_p99": "TTFT p99", "tpot_mean": "TPOT mean",
           "jct_mean": "JCT mean", "throughput_tokens": "throughput"}


def format_errors(case: Case, result: dict) -> str:
    lines = [(f"{case.name}: {result['num_requests']} requests at {result['rate']:.2f} req/s; "
              f"{result['real']['uptime_before']}")]
    for name, e in result["errors"].items():
        err = "-" if e["relative_error"] is None else f"{e['relative_error']:+.1%}"
        lines.append(f"  {name:<18} real {e['real']!s:<24.24} simulated {e['simulated']!s:<24.24}"
                     f" error {err:>8} (target {e['target']:.0%})")
    busy = result.get("forward_time") or {}
    if busy.get("relative_error") is not None:
        lines.append(f"  {'forward seconds':<18} real {busy['real']:<24.3f} simulated "
                     f"{busy['simulated']:<24.3f} error {busy['relative_error']:+8.1%} "
                     "(diagnostic)")
    if busy.get("real_overhead_per_forward_s") is not None:
        lines.append(f"  {'forwards':<18} real {busy['real_forwards']:<24.0f} simulated "
                     f"{busy['simulated_forwards']:<24} loop overhead "
                     f"{busy['real_overhead_per_forward_s'] * 1e3:.1f} ms per real forward")
    return "\n".join(lines)


def case_files(directory: Path) -> list[Path]:
    """A validation directory's case files (not its calibrations or previous-run.json)."""
    return sorted(p for p in directory.glob("*.json")
                  if not p.name.startswith("calibration-") and p.name != "previous-run.json")


def cell(error: dict) -> str:
    value = error.get("relative_error")
    if value is None:
        return "-"
    return f"{value:+.1%}" + ("" if error["within_target"] else " *")


def row(label: str, result: dict, errors: dict | None = None) -> list[str]:
    """One table row; `errors` instead of the case's own (its uncalibrated ones)."""
    busy = (result.get("forward_time") or {}).get("relative_error")
    priced = ((result.get("forward_classes") or {}).get("all") or {}).get("real_over_model")
    return [label, f"{result['rate']:.2f}",
            *[cell((errors or result["errors"])[name]) for name in METRICS],
            "-" if busy is None else f"{busy:+.1%}",
            "-" if priced is None else f"{priced:.3f}"]


def rows(label: str, result: dict) -> list[list[str]]:
    """The case's row; a calibrated case's two (the profile alone, then calibrated: k, loop
    work); then the replay at the run's own forward speed, where it has one."""
    calibration, own = result.get("calibration"), result.get("own_speed")
    lines = [row(label, result)]
    if calibration:
        lines = [row(f"{label}, profile alone", result, calibration["errors_uncalibrated"]),
                 row(f"{label}, held-out {measures(calibration, result)}", result)]
    tracked = result.get("speed_tracked")
    if tracked:
        drift = tracked["drift"]
        lines.append(row(f"{label}, held-out moved by the probes' drift x{drift['decode']:.2f}/"
                         f"{drift['prompt']:.2f}", result, tracked["errors"]))
    previous = result.get("previous_run")
    if previous:
        lines.append(row(f"{label}, the run before ({previous['source']}) "
                         f"{measures(previous, result)}", result, previous["errors"]))
    if own:
        lines.append(row(f"{label}, own run's {measures(own)}", result, own["errors"]))
    return lines


def measures(calibration: dict, result: dict | None = None) -> str:
    """k (decode / prompt-carrying where both were measured), the loop's work per forward, the
    request path, and the wake-up and KV hand-off where they were measured."""
    k = f"k {calibration['factor']:.2f}"
    if calibration.get("prompt_factor"):
        k += f"/{calibration['prompt_factor']:.2f}"
    overhead = (result or calibration).get("turn_overhead_s", 0.0)
    text = f"{k}, {overhead * 1e3:.2f} ms/forward"
    if calibration.get("request_latency_s") is not None:
        text += f", path {calibration['request_latency_s'] * 1e3:.1f} ms"
    if calibration.get("wake_s"):
        text += f", wake {calibration['wake_s'] * 1e3:.1f} ms"
    if calibration.get("handoff_s") is not None:
        text += f", hand-off {calibration['handoff_s'] * 1e3:.0f} ms"
        if calibration.get("handoff_per_token_s"):
            text += f" + {calibration['handoff_per_token_s'] * 1e6:.0f} us/token"
    return text


def table(directories: list[Path]) -> str:
    header = ["case", "req/s", *[HEADERS[name] for name in METRICS], "forward s",
              "real/model"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for directory in directories:
        for path in case_files(directory):
            result = json.loads(path.read_text())
            label = f"{path.stem} ({directory.name})" if len(directories) > 1 else path.stem
            failed = result.get("real", {}).get("summary", {}).get("num_errors", 0)
            if failed:  # the simulated side serves them: the two runs do not compare evenly
                label += f" [{failed} real request{'s' * (failed > 1)} failed]"
            lines += ["| " + " | ".join(cells) + " |" for cells in rows(label, result)]
    return "\n".join(lines)


SIDES = ("held out", "tracked", "run before", "own speed")


def sides(result: dict, previous: dict | None = None) -> dict[str, tuple[dict, dict]]:
    """(k and the rest measured, errors) of each side a case has; `previous`: its run-before
    side from a previous-run.json, where the case file has none."""
    found = {"held out": (result.get("calibration") or {}, result["errors"])}
    for side, key in (("tracked", "speed_tracked"), ("run before", "previous_run"),
                      ("own speed", "own_speed")):
        value = result.get(key) or (previous if side == "run before" else None)
        if value:
            found[side] = (value, value["errors"])
    return found


def counts(directories: list[Path]) -> str:
    """A markdown table, one row per case: each side's k (decode/prompt) and errors; then per
    side how many cases meet all five targets and the TTFT mean's (the median absolute TTFT
    mean error)."""
    tally: dict[str, list] = {side: [] for side in SIDES}
    lines = ["| case | req/s | " + " | ".join(f"{side}: k, " + " / ".join(
        HEADERS[m] for m in METRICS) for side in SIDES) + " |", "|---|---|" + "---|" * len(SIDES)]
    for directory in directories:
        extra = directory / "previous-run.json"
        before = json.loads(extra.read_text()) if extra.is_file() else {}
        for path in case_files(directory):
            result = json.loads(path.read_text())
            found = sides(result, (before.get(path.stem) or {}).get("run_before"))
            cells = []
            for side in SIDES:
                measured, errors = found.get(side, (None, None))
                if errors is None:
                    cells.append("-")
                    continue
                tally[side].append(errors)
                k = f"{measured.get('factor') or 0:.2f}/{measured.get('prompt_factor') or 0:.2f}"
                cells.append(f"k {k}: " + " / ".join(cell(errors[m]) for m in METRICS))
            label = f"{path.stem} ({directory.name})" if len(directories) > 1 else path.stem
            lines.append(f"| {label} | {result['rate']:.2f} | " + " | ".join(cells) + " |")
    lines += ["", "| side | cases | all five targets | TTFT mean within 5% | median TTFT mean "
              "error |", "|---|---|---|---|---|"]
    for side, errors in tally.items():
        if errors:
            five, within, median = target_counts(errors)
            lines.append(f"| {side} | {len(errors)} | {five} | {within} | {median:.1%} |")
    return "\n".join(lines)


def target_counts(errors: list[dict]) -> tuple[int, int, float]:
    """Of cases' errors (`simulator.validate.errors`): how many meet all five targets, how many
    the TTFT mean's, and the median absolute TTFT mean error."""
    five = sum(all(e[m]["within_target"] for m in METRICS) for e in errors)
    within = sum(e["ttft_mean"]["within_target"] for e in errors)
    return five, within, statistics.median(abs(e["ttft_mean"]["relative_error"]) for e in errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.validation_table",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("directories", nargs="+", type=Path)
    parser.add_argument("--counts", action="store_true",
                        help="one row per case with each side's errors, and counts per side")
    args = parser.parse_args(argv)
    print(counts(args.directories) if args.counts else table(args.directories))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
