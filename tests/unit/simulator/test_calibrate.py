"""simulator.calibrate: the forward scale that fits a real run, and CostModel.scaled."""

from __future__ import annotations

import json
import math

import pytest

from common.config import ConfigError
from common.plan import BatchPlan, ScheduledChunk
from simulator.calibrate import fit_factor, mismatch
from simulator.run import simulate
from simulator.workload import SyntheticShape, synthetic

from unit.simulator.sim_fixtures import COSTS, coupled
from unit.simulator.test_cli import RECORD, ROOT


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


def test_an_earlier_held_out_run_is_simulated_at_the_rate_it_ran_at(tmp_path, monkeypatch):
    """Re-simulating a held-out run under another profile (--real-from) must not move its
    arrivals to the rate the new profile would pick."""
    import simulator.forward_check
    from simulator import validate as v
    from simulator.calibrate import calibrate_case

    case = v.Case("1P1D", "LPLD", "low", 9)
    summary = json.loads((ROOT / "docs/benchmarks/simulator_validation/zen3-5/"
                          "1P1D-HPLD-low-s0.json").read_text())["real"]["summary"]
    (tmp_path / f"calibration-{case.name}.json").write_text(json.dumps(
        {"rate": 0.123, "real": {"summary": summary}}))
    seen = []

    def simulated_run(case, requests, arrivals, costs, cache_dir, charges=None):
        seen.append(list(arrivals))
        return {"summary": summary, "forwards": []}

    monkeypatch.setattr(v, "simulated_run", simulated_run)
    # arrivals that name their rate (no tokenizer needed)
    monkeypatch.setattr(v, "bench_requests", lambda case, num, rate: ([None] * num, [rate] * num))
    monkeypatch.setattr(simulator.forward_check, "forward_classes", lambda *args: {})
    profiles = v.load_profiles([str(RECORD)])
    result = calibrate_case(case, 5, profiles, "cache", tmp_path / "out", "latencies", tmp_path)
    assert result["rate"] == 0.123 and seen
    assert all(arrivals == [0.123] * 5 for arrivals in seen)
    assert v.case_rate(case, v.profile_for(profiles, 1)[0]) != 0.123
