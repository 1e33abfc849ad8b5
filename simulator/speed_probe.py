"""The machine's forward speed at the time of a real run, measured beside its load (issue 23).

A held-out calibration (simulator.calibrate) measures k, the in-service forward seconds over
the profile's, on a run at another seed minutes before the cases; on a shared 2-core host that
speed drifts by more than the targets within minutes (2026-12-02's Zen 3: the held-out k of a
set 1.15 against its cases' 1.02-1.10). The speed probe follows the drift without looking at
a case's load: each real run sends the same few requests alone just before its load and just
after (one prompt of a few hundred tokens and one output token, twice; one short prompt with
DECODE_STEPS output tokens), and the forward log prices those forwards. A case's tracked k is
the held-out k times the ratio of its probes' speed to the held-out run's probes' speed, per
kind (decode steps, prompt-carrying forwards): the in-service share of k (the gateway and
client on the same cores) still comes from the held-out load, the machine's drift from the
probes. On 2026-12-02's Zen 1 the probes followed drift between runs (a slow held-out run) but
not the larger swings within a load, so the tracked row is a diagnostic beside the held-out
one (docs/simulator.md, "Runs of 2026-12-02, tenth session").
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from common.engine.forward_log import WAITED_S
from simulator.calibrate import charges, kind_ratios, scaled
from simulator.costs import CostModel

DECODE_STEPS = 24  # one sequence's decode steps: a second or two on a CPU core
FILLER = "The quick brown fox jumps over the lazy dog while the cat watches. "
PROMPT_REPEATS = 20  # about 280 tokens: several prefill chunks on a 1-thread instance


def probe_requests(request, tag: str = "") -> list:
    """Three requests (bench's, fields of `request` otherwise): two distinct long prompts with
    one output token (distinct, so the second finds nothing cached) and a short one with
    DECODE_STEPS output tokens. `tag` sets a run's probes apart (its probes after the load must
    not find those before it cached). No workload holds these prompts."""
    long = [replace(request, prompt=f"Speed probe {tag}{i}. " + FILLER * PROMPT_REPEATS,
                    max_tokens=1) for i in range(2)]
    return [*long, replace(request, prompt=f"Speed probe {tag}: count upwards from one.",
                           max_tokens=DECODE_STEPS)]


def probe(url: str, model: str, request, sampling: dict | None = None, tag: str = "") -> dict:
    """Send `probe_requests(request, tag)` one after another (each alone on the cluster); the
    wall-clock window to cut the forward log to, and whether every request finished."""
    from bench.client import run_load

    start, records = time.time(), []
    for one in probe_requests(request, tag):
        records += asyncio.run(run_load(url, model, [one], [0.0], ignore_eos=True,
                                        progress=False, **(sampling or {})))
    return {"window": [start, time.time()], "errors": [r.error for r in records if r.error]}


def speeds(probes: list[dict], lines: list[dict], costs: CostModel) -> dict | None:
    """Measured over modelled seconds of the probes' decode steps and prompt-carrying forwards
    (`lines`: every instance's forward log; `probes`: a run's probe windows), each priced at
    its shape; the first forward after the loop waited is left out (its wake-up is not the
    machine's speed). None when a kind has no forward in the windows."""
    priced = [(line, costs.shape_s(line["shape"])) for line in lines
              if line.get("gap_s", 0.0) <= WAITED_S
              and any(p["window"][0] <= line["time"] <= p["window"][1] for p in probes)]
    ratios = kind_ratios(priced, priced)
    return None if None in ratios.values() else ratios


def tracked(calibration: dict, case_speeds: dict | None, held_out_speeds: dict | None) \
        -> dict | None:
    """`calibration` (simulator.calibrate's, held out) with its factors moved by the machine's
    drift between its run and the case's: k x case probes' speed / held-out probes' speed, per
    kind. None when either run lacks its probes' speeds."""
    if not case_speeds or not held_out_speeds or "factor" not in calibration:
        return None
    decode = case_speeds["decode"] / held_out_speeds["decode"]
    prompt = case_speeds["prompt"] / held_out_speeds["prompt"]
    factor = calibration["factor"] * decode
    prompt_factor = (calibration.get("prompt_factor") or calibration["factor"]) * prompt
    return {**calibration, "factor": factor, "prompt_factor": prompt_factor,
            "drift": {"decode": decode, "prompt": prompt}}


def run_speeds(real: dict, logs: dict[str, list[dict]] | None, costs: CostModel) -> dict | None:
    """`speeds` of a real run's probes (`real["speed_probes"]`), from its forward logs (`logs`:
    simulator.calibrate.run_logs); None for a run without probes or logs."""
    probes = real.get("speed_probes")
    if not probes or logs is None:
        return None
    return speeds(probes, [line for lines in logs.values() for line in lines], costs)


def speed_tracked(case, requests: list, arrivals: list[float], real: dict,
                  logs: dict | None, measured: CostModel, calibration: dict | None,
                  cache_dir: str, overhead: float) -> dict | None:
    """The case simulated with its held-out calibration moved by the machine's drift since the
    held-out run (the probes around each load, not the load itself; `overhead`: the loop work
    per forward the case's other simulations charge); None without a calibration or either
    run's probes."""
    from simulator import validate as v

    case_speeds = run_speeds(real, logs, measured)
    moved = tracked(calibration or {}, case_speeds, (calibration or {}).get("probe_speeds"))
    if moved is None:
        return None
    replay = v.simulated_run(case, requests, arrivals, scaled(measured, moved), cache_dir,
                             {**charges(moved), "turn_overhead_s": overhead})
    return {"factor": moved["factor"], "prompt_factor": moved["prompt_factor"],
            "drift": moved["drift"], "probe_speeds": case_speeds,
            "errors": v.errors(real["summary"], replay["summary"])}
