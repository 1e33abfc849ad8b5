"""simulator.calibrate: the forward scale that fits a real run, and CostModel.scaled."""

from __future__ import annotations

import math

import pytest

from common.config import ConfigError
from common.plan import BatchPlan, ScheduledChunk
from simulator.calibrate import fit_factor, mismatch
from simulator.run import simulate
from simulator.workload import SyntheticShape, synthetic

from unit.simulator.sim_fixtures import COSTS, coupled


def test_scaled_multiplies_every_forward_and_nothing_else():
    plan = BatchPlan([ScheduledChunk("a", [1] * 40, 100, [0], None)])
    assert COSTS.scaled(1.5).forward_s(plan) == pytest.approx(1.5 * COSTS.forward_s(plan))
    assert COSTS.scaled(1.5).decode_s(7, 300) == pytest.approx(1.5 * COSTS.decode_s(7, 300))
    assert COSTS.scaled(1.5).kv_bytes_per_token == COSTS.kv_bytes_per_token
    assert "scaled by 1.500" in COSTS.scaled(1.5).notes[-1]
    with pytest.raises(ConfigError):
        COSTS.scaled(0)


def test_mismatch_is_zero_for_equal_summaries_and_infinite_without_a_metric():
    summary = {"ttft_s": {"mean": 1.0}, "tpot_s": {"mean": 0.1}, "jct_s": {"mean": 5.0}}
    assert mismatch(summary, summary) == 0.0
    assert mismatch(summary, {**summary, "tpot_s": {"mean": None}}) == math.inf


def test_the_fitted_factor_recovers_a_known_slowdown():
    # a "real" run that is the simulation with every forward 1.3x slower
    requests = synthetic(60, 8.0, 1, SyntheticShape(prompt_median=60, output_median=30,
                                                    max_prompt_tokens=200, max_output_tokens=80))
    layout = coupled("sarathi")

    def run(k: float) -> dict:
        return simulate(layout, COSTS.scaled(k), requests, seed=0)

    factor, tried = fit_factor(run(1.3), run, grid=(1.0, 1.1, 1.2, 1.3, 1.4, 1.5))
    assert factor == 1.3 and len(tried) == 6
    assert min(r["mismatch"] for r in tried) == 0.0
