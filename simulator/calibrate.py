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
"""

from __future__ import annotations

import math
from collections.abc import Callable

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
