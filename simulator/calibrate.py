"""Calibrating a fitted cost model to the serving stack of the machine it runs on (issue 23).

A `splitserve profile` record times the model's forwards alone. In service the same forwards
share the machine with the gateway, the client and the other instances: on the 2-core
development machine a 2-thread co-located instance ran its forwards about a third slower than
profiled (docs/simulator.md, validation). `fit_factor` measures that from one held-out run: the
case's layout, workload and rate at a seed the validation does not use, run for real once, then
the single factor k scaling every forward (`CostModel.scaled`) that brings the simulated mean
TTFT, TPOT and JCT closest to the real ones (least squares on their log ratios over a grid of
k). The validation cases then run with the scaled model and report k beside their errors. On a
GPU host the serving processes run on CPU cores the forwards do not use, so k near 1 is
expected there; a k far from 1 says the profile does not describe the deployment.

`from_forwards` measures the same thing without fitting anything to the latencies: the held-out
run's forward log (`common.engine.forward_log`) holds each forward's shape and measured seconds,
so k is measured seconds over the model's seconds for the same shapes, and the instance loop's
own work per forward (its turns less its forwards) is read off the same lines, and the request
path's latency from the probes before its load (`simulator.request_path`); the simulation then
charges them (`CostModel.scaled`, `Layout.turn_overhead_s`, `Layout.request_latency_s`), with
the extra time of a forward its instance woke up for (`Layout.wake_s`: forwards after the
loop waited for work ran longer than their shape's price) and the KV hand-off's time beyond the
link, fixed and per prompt token (`Layout.handoff_s`, `Layout.handoff_per_token_s`,
`simulator.request_path.handoff`). `calibrate_case` runs the
held-out case for either mode (`python -m simulator.validate --calibration-seed N
--calibration forwards|latencies`). `own_speed` applies `from_forwards` to a case's own run
instead (not held out): a diagnostic of what the simulated loop gets wrong once the speed the
machine actually ran at is known.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from common.engine.forward_log import WAITED_S as WAIT_S
from simulator.cores import work_seconds
from simulator.costs import CostModel

# What a calibration charges beside the scaled cost model: Layout fields
CHARGES = ("turn_overhead_s", "request_latency_s", "wake_s", "wake_prompt_s", "handoff_s",
           "handoff_per_token_s", "shared_cores", "core_threads")

# the metrics k is fitted to (paths in bench's summary)
CALIBRATION_METRICS = (("ttft_s", "mean"), ("tpot_s", "mean"), ("jct_s", "mean"))
GRID = tuple(round(0.5 + 0.01 * i, 2) for i in range(151))  # k from 0.5 to 2.0


def mismatch(real: dict, simulated: dict) -> float:
    """Sum of squared log ratios simulated / real over the calibration metrics."""
    total = 0.0
    for group, stat in CALIBRATION_METRICS:
        r, s = (real.get(group) or {}).get(stat), (simulated.get(group) or {}).get(stat)
        if not r or not s:
            return math.inf
        total += math.log(s / r) ** 2
    return total


def fit_factor(real: dict, simulate_at: Callable[[float], dict],
               grid: tuple[float, ...] = GRID) -> tuple[float, list[dict]]:
    """The k of `grid` whose simulation (`simulate_at(k)`: bench's summary) is closest to the
    real run's summary, and every k tried with its mismatch (the first of equals wins)."""
    tried = [{"factor": k, "mismatch": mismatch(real, simulate_at(k))} for k in grid]
    best = min(tried, key=lambda row: row["mismatch"])
    return best["factor"], tried


def per_row_fit(lines: list[dict], costs: CostModel) -> tuple[float, float]:
    """(k, c): decode steps' measured seconds ~ k x their price + c x their sampled rows, least
    squares, c >= 0 (c = 0 and k the plain ratio otherwise): a per-token in-service cost beside
    the slowdown (the gateway's and client's work per streamed token on the same cores)."""
    decodes = [line for line in lines if line["shape"].kind == "decode"]
    if not decodes:
        return 1.0, 0.0
    m = [costs.shape_s(line["shape"]) for line in decodes]
    r = [float(line["shape"].rows) for line in decodes]
    y = [line["forward_s"] for line in decodes]
    mm, rr, mr = sum(a * a for a in m), sum(b * b for b in r), sum(a * b for a, b in zip(m, r))
    my, ry = sum(a * b for a, b in zip(m, y)), sum(a * b for a, b in zip(r, y))
    det = mm * rr - mr * mr
    k, c = ((my * rr - ry * mr) / det, (ry * mm - my * mr) / det) if det else (0.0, -1.0)
    if c < 0 or k <= 0:
        return sum(y) / sum(m), 0.0
    return k, c


def from_forwards(lines: list[dict], costs: CostModel, per_row: bool = False,
                  cores: int | None = None, threads: int = 1) -> dict:
    """k = measured / modelled seconds over a forward log's decode steps (each priced at its own
    shape), the same ratio over its forwards that carry a prompt chunk (`prompt_factor`: a
    1-thread prefill instance slowed 26-33% in service where decode steps did not), the loop's
    mean seconds per forward beyond the forward, and the wake-up (`Layout.wake_s` for decode
    steps, `wake_prompt_s` for prompt-carrying forwards, each the other's where the log has none
    of its kind after a wait): how much
    longer than k x its price a forward ran when the loop had waited for work before it. The
    ratios come from the forwards that followed another without a wait (all of a kind when none
    did); a kind the log lacks takes the other's ratio. With `cores` (the instances shared that
    many cores, `threads` threads each: `Layout.shared_cores`) every ratio is of the seconds of
    work each forward did (`simulator.cores.work_seconds`), not of its wall time, and the result
    carries `shared_cores` and `core_threads` for the simulation."""
    if not lines:
        raise ValueError("the held-out run's forward log has no forward in its load window")
    worked = work_seconds(lines, cores, threads) if cores else lines
    priced = [(line, costs.shape_s(line["shape"])) for line in worked]
    woke = [(line, model) for line, model in priced if line.get("gap_s", 0.0) > WAIT_S]
    ratios = kind_ratios([(line, model) for line, model in priced
                          if line.get("gap_s", 0.0) <= WAIT_S], priced)
    factor = ratios["decode"] or ratios["prompt"]
    prompt_factor = ratios["prompt"] or ratios["decode"]
    excess: dict[str, list[float]] = {"decode": [], "prompt": []}
    for line, model in woke:
        decode = line["shape"].kind == "decode"
        excess["decode" if decode else "prompt"].append(
            line["forward_s"] - model * (factor if decode else prompt_factor))
    pooled = excess["decode"] + excess["prompt"]
    wake = {kind: max(statistics.fmean(values or pooled), 0.0) if pooled else 0.0
            for kind, values in excess.items()}
    measured = sum(line["forward_s"] for line in worked)
    modelled = sum(model for _, model in priced)
    overhead = sum(max(line["turn_s"] - line["forward_s"], 0.0) for line in lines) / len(lines)
    result = {"factor": factor, "prompt_factor": prompt_factor,
              "overall_factor": measured / modelled, "turn_overhead_s": overhead,
              "wake_s": wake["decode"], "wake_prompt_s": wake["prompt"],
              "woke_forwards": len(woke),
              "forwards": len(lines), "measured_s": measured, "modelled_s": modelled}
    if cores:
        result.update(shared_cores=cores, core_threads=threads)
    if per_row:  # mode "forwards-rows"
        result["factor"], result["per_row_s"] = per_row_fit(worked, costs)
    return result


def kind_ratios(chosen: list[tuple[dict, float]], every: list[tuple[dict, float]]) -> dict:
    """Measured / modelled seconds of the decode steps and of the prompt-carrying forwards among
    `chosen` (of `every` where `chosen` has none of that kind; None where neither has)."""
    ratios = {}
    for kind in ("decode", "prompt"):
        for pairs in (chosen, every):
            of_kind = [(line, model) for line, model in pairs
                       if (line["shape"].kind == "decode") == (kind == "decode")]
            if of_kind:
                break
        modelled = sum(model for _, model in of_kind)
        measured = sum(line["forward_s"] for line, _ in of_kind)
        ratios[kind] = measured / modelled if modelled else None
    return ratios


def calibrate_case(case, num: int, profiles: list, cache_dir: str, out: Path,
                   mode: str = "forwards", real_from: Path | None = None) -> dict:
    """The held-out run of `case` (a seed the validation does not use) for real once (or its
    earlier run in `real_from`, at the rate it ran at), then `from_forwards` on its forward
    log, or (mode "latencies") `fit_factor` on its summary; written as
    calibration-<case>.json."""
    from simulator import validate as v
    from simulator.forward_check import forward_classes
    from simulator.speed_probe import run_speeds

    costs, profile = v.profile_for(profiles, v.LAYOUTS[case.layout][1])
    path = real_from / f"calibration-{case.name}.json" if real_from else None
    earlier = json.loads(path.read_text()) if path and path.is_file() else None
    # an earlier run is simulated at the rate it ran at, whatever rate this profile would pick
    rate = earlier["rate"] if earlier else v.case_rate(case, costs)
    requests, arrivals = v.bench_requests(case, num, rate)
    real = earlier["real"] if earlier else v.real_run(case, requests, arrivals, cache_dir,
                                                      out / "logs", profile["path"])
    result = {"case": asdict(case), "mode": mode, "rate": rate, "profile": profile,
              "turn_overhead_s": 0.0}
    logs = run_logs(real)
    lines = case_lines(real, logs)
    if mode in ("forwards", "forwards-rows"):
        result.update(from_forwards(lines or [], costs, mode == "forwards-rows",
                                    **v.sharing(case)), **path_charges(real, logs))
    elif mode == "latencies":
        result["factor"], result["tried"] = fit_factor(real["summary"], lambda k: v.simulated_run(
            case, requests, arrivals, costs.scaled(k), cache_dir)["summary"])
    else:
        raise ValueError(f"unknown calibration mode {mode!r}: forwards or latencies")
    result["probe_speeds"] = run_speeds(real, logs, costs)
    fitted = v.simulated_run(case, requests, arrivals, scaled(costs, result), cache_dir,
                             charges(result))
    result["errors_at_factor"] = v.errors(real["summary"], fitted["summary"])
    result["forward_classes"] = forward_classes(lines, fitted.pop("forwards"), costs)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"calibration-{case.name}.json").write_text(
        json.dumps({**result, "real": real}, indent=1, default=str) + "\n")
    return result


def own_speed(case, requests: list, arrivals: list[float], real: dict,
              logs: dict[str, list[dict]] | None, costs: CostModel, cache_dir: str) -> dict | None:
    """The case simulated again at the forward speed its own real run had (`from_forwards` on
    its own `logs`, `run_logs(real)`: not held out, a diagnostic): what is left of the error
    once the machine's speed during the run is known is the simulated loop's, not the cost
    model's. None without a forward log."""
    from simulator.validate import sharing

    if logs is None:
        return None
    speed = {**from_forwards(case_lines(real, logs), costs, **sharing(case)),
             **path_charges(real, logs)}
    return simulate_with(case, requests, arrivals, real["summary"], costs, speed, cache_dir)


def simulate_with(case, requests: list, arrivals: list[float], real_summary: dict,
                  costs: CostModel, measured: dict, cache_dir: str) -> dict:
    """The case simulated with what a run measured (k per kind and the charges: a
    calibration, a case's own run, the run before it): `measured` with the errors against
    `real_summary` beside it."""
    from simulator import validate as v

    replay = v.simulated_run(case, requests, arrivals, scaled(costs, measured), cache_dir,
                             charges(measured))
    return {**measured, "errors": v.errors(real_summary, replay["summary"])}


def scaled(costs: CostModel, calibration: dict) -> CostModel:
    """`costs` with a calibration's factors (a latencies calibration has no prompt factor) and
    its per-row in-service cost, if it measured one."""
    model = costs.scaled(calibration["factor"], calibration.get("prompt_factor"))
    per_row = calibration.get("per_row_s") or 0.0
    return replace(model, per_sampled_row_s=model.per_sampled_row_s + per_row) if per_row \
        else model


def charges(calibration: dict) -> dict:
    """The Layout fields a calibration sets beside the cost model (what it did not measure: 0;
    a calibration from before the wake-up per kind: its one wake_s for both kinds)."""
    return {name: calibration.get(name) or 0.0 for name in CHARGES} | {
        "wake_prompt_s": calibration.get("wake_prompt_s", calibration.get("wake_s") or 0.0),
        "shared_cores": calibration.get("shared_cores"),  # measured before: None, no sharing
        "core_threads": calibration.get("core_threads") or 1}


def path_charges(real: dict, logs: dict[str, list[dict]] | None) -> dict:
    """The request path's latency (simulator.request_path: None when the run had no probe) and
    the KV hand-off's (None for a run without a log, or without a hand-off to read); `logs`:
    `run_logs(real)`."""
    from simulator.request_path import handoff, latency

    probe = real.get("path_probe")
    handed = (handoff(logs, real["load_window"]) if logs else None) or {"handoff_s": None}
    return {"request_latency_s": (latency(probe, within(logs, *probe["window"]))
                                  if probe and logs is not None else None), **handed}


def run_logs(real: dict) -> dict[str, list[dict]] | None:
    """Each instance's whole forward log of a real run, by instance id, read once; None for a
    run recorded without a log, or whose log is gone (logs stay out of git)."""
    from common.engine.forward_log import read

    directory = Path(real.get("forward_log") or "")
    if not real.get("load_window") or not directory.is_dir():
        return None
    return {path.stem: read(path) for path in sorted(directory.glob("*.jsonl"))}


def case_lines(real: dict, logs: dict[str, list[dict]] | None) -> list[dict] | None:
    """Every instance's forward-log lines within the real run's load window (`logs`:
    `run_logs(real)`); None without a log."""
    return None if logs is None else within(logs, *real["load_window"])


def within(logs: dict[str, list[dict]], start: float, end: float) -> list[dict]:
    """Every instance's lines whose forward ended within [start, end] (as forward_log.read
    cuts them)."""
    return [line for lines in logs.values() for line in lines if start <= line["time"] <= end]
