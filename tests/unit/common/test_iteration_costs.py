"""The profiled cost model (common.schedulers.costs) and what reads it: FastServe's job profiler,
its reserve rule, and the token budget chosen from a TBT SLO. Synthetic profiles, no model."""

from __future__ import annotations

import json
import logging

import pytest

from common.config import BatchConfig, ConfigError
from common.schedulers.costs import (
    IterationCosts,
    recorded_costs,
    token_budget_for_tbt,
)
from common.schedulers.fastserve import (
    ArrivalBursts,
    FastServeOptions,
    JobProfiler,
    reserve_blocks,
)

# forward(n) = 0.010 + 0.0001 (n - 1) s for n in 1..1000; decode steps cost more than as many
# prompt tokens: 0.001 s more at batch 1, 0.0091 s more at batch 10.
LINEAR = IterationCosts(prefill=((1, 0.010), (1000, 0.1099)), decode=((1, 0.011), (10, 0.020)),
                        source="synthetic")


def report(model="m", dtype="float32"):
    return {"model": model, "dtype": dtype, "recommended_chunk_size": 256,
            "prefill": [{"tokens": 1, "seconds": 0.01}, {"tokens": 4, "seconds": 0.009},
                        {"tokens": 100, "seconds": 0.05}],
            "decode": [{"batch": 1, "step_seconds": 0.012}, {"batch": 32, "step_seconds": 0.03}]}


# -- the curves ----------------------------------------------------------------------------------
def test_curves_interpolate_flatten_dips_and_extrapolate_the_last_slope():
    costs = IterationCosts.from_report(report())
    assert costs.prefill == ((1, 0.01), (4, 0.01), (100, 0.05))  # the dip at 4 is noise
    assert costs.forward_s(1) == costs.forward_s(0) == 0.01
    assert costs.forward_s(52) == pytest.approx(0.03)  # halfway from 4 to 100
    assert costs.forward_s(196) == pytest.approx(0.09)  # 0.04 per 96 tokens past the last point
    assert costs.decode_step_s(1) == 0.012 and costs.max_profiled_tokens == 100


def test_a_mixed_forward_is_exact_at_both_ends():
    assert LINEAR.mixed_s(500, 0) == LINEAR.forward_s(500)
    assert LINEAR.mixed_s(0, 10) == pytest.approx(LINEAR.decode_step_s(10))
    # 90 prompt tokens + 10 decodes: a 100-token forward plus the decodes' extra 0.0091 s
    assert LINEAR.mixed_s(90, 10) == pytest.approx(0.010 + 0.0099 + 0.0091)


def test_profiles_load_only_for_the_model_and_dtype_they_measured(tmp_path):
    (tmp_path / "profile.json").write_text(json.dumps(report()))
    assert recorded_costs(str(tmp_path), "m", "float32").decode_step_s(32) == 0.03
    assert recorded_costs(str(tmp_path), "m", "bfloat16") is None
    assert recorded_costs(str(tmp_path), "other", "float32") is None
    assert recorded_costs(str(tmp_path), "m", "float32", threads=2) is None  # not recorded
    old = tmp_path / "old"  # a record from before the curves were recorded
    old.mkdir()
    (old / "profile.json").write_text(json.dumps({"recommended_chunk_size": 256, "model": "m"}))
    assert recorded_costs(str(old)) is None and recorded_costs(str(tmp_path / "missing")) is None
    with pytest.raises(ConfigError):
        IterationCosts(prefill=(), decode=((1, 0.01),))


def test_splitserve_profile_records_the_curves_the_policies_read(tmp_path):
    from common.engine.profile import _record, recorded_chunk_size

    full = {**report(), "threads": 2, "decode_context": 256}
    full["prefill"][0]["tokens_per_s"] = 100.0  # the full report's other columns stay out
    _record(full, str(tmp_path))
    assert recorded_chunk_size(str(tmp_path)) == 256
    assert recorded_costs(str(tmp_path), "m", "float32", threads=2) == \
        IterationCosts.from_report(report(), source=str(tmp_path / "profile.json"))


# -- the token budget from a TBT SLO (Sarathi-Serve §4.3) ----------------------------------------
def test_the_budget_is_the_largest_forward_whose_worst_mix_meets_the_slo():
    # T >= 10: 0.010 + 0.0001 (T - 1) + 0.0091 <= 0.05005  ->  T - 1 <= 309.5
    assert token_budget_for_tbt(LINEAR, 0.05005, max_num_seqs=10) == 310
    # at most one decode per forward: only its 0.001 s extra  ->  T - 1 <= 390.5
    assert token_budget_for_tbt(LINEAR, 0.05005, max_num_seqs=1) == 391
    assert token_budget_for_tbt(LINEAR, 0.2, max_num_seqs=10) == 1000  # never extrapolated
    assert token_budget_for_tbt(LINEAR, 0.2, max_num_seqs=10, max_tokens=4096) > 1000
    with pytest.raises(ConfigError, match="below the profiled time"):
        token_budget_for_tbt(LINEAR, 0.005, max_num_seqs=10)
    with pytest.raises(ConfigError):
        token_budget_for_tbt(LINEAR, 0.0, max_num_seqs=10)


# -- FastServe's job profiler --------------------------------------------------------------------
def test_the_job_profiler_reads_the_profile_and_explicit_options_override_it(caplog):
    profiler = JobProfiler.build(FastServeOptions(), LINEAR)
    assert profiler.q1 == 0.011 and profiler.source == "synthetic"  # decode step at batch 1
    assert profiler.iteration_s(1) == 0.011
    assert profiler.iteration_s(101) == pytest.approx(0.020)  # the profiled forward
    explicit = JobProfiler.build(FastServeOptions(seconds_per_decode_iteration=1.0), LINEAR)
    assert explicit.q1 == 1.0 and explicit.iteration_s(101) == 1.0
    assert JobProfiler.build(FastServeOptions(seconds_per_prefill_token=0.5),
                             LINEAR).iteration_s(4) == 2.0
    with caplog.at_level(logging.WARNING):
        fallback = JobProfiler.build(FastServeOptions(), None)
    assert "no profile" in caplog.text and fallback.source == "fallback constants"
    assert fallback.q1 == 0.02 and fallback.iteration_s(100) == pytest.approx(0.075)


def test_skip_join_uses_the_profiled_prefill_time():
    from common.block_pool import KVCacheManager
    from common.sampling_params import SamplingParams
    from common.schedulers.coupled import make_coupled_scheduler
    from common.sequence import Sequence

    sched = make_coupled_scheduler("fastserve", BatchConfig(), KVCacheManager(64, 16),
                                   options={"num_queues": 4}, costs=LINEAR)
    assert sched.mlfq.quanta == pytest.approx([0.011, 0.022, 0.044, 0.088])
    for seq_id, prompt in (("short", 2), ("mid", 150), ("long", 700)):
        sched.add(Sequence(seq_id, list(range(1, prompt + 1)), SamplingParams(), 2048))
    # forward 0.0101, 0.0249, 0.0799 s: Q1, Q3 (> 0.022), Q4
    assert [sched.mlfq.level(s) for s in ("short", "mid", "long")] == [0, 2, 3]


# -- FastServe's reserve rule --------------------------------------------------------------------
def test_the_reserve_is_the_burst_plus_the_next_tokens_capped():
    assert reserve_blocks(fixed=0, next_token_blocks=2, burst=5, num_blocks=100,
                          max_fraction=0.5) == 7
    assert reserve_blocks(fixed=3, next_token_blocks=2, burst=5, num_blocks=100,
                          max_fraction=0.5) == 10
    assert reserve_blocks(fixed=0, next_token_blocks=2, burst=50, num_blocks=100,
                          max_fraction=0.5) == 50
    assert reserve_blocks(fixed=0, next_token_blocks=2, burst=5, num_blocks=9,
                          max_fraction=0.5) == 4


def test_the_burst_is_the_largest_arrival_between_two_iterations_in_the_window():
    bursts = ArrivalBursts(window=3)
    seen = []
    for arrivals in ([4, 2], [], [1], [], [], [3]):
        for blocks in arrivals:
            bursts.arrived(blocks)
        seen.append(bursts.close_iteration())
    # 6 stays for three iterations, then falls out of the window
    assert seen == [6, 6, 6, 1, 1, 3]
    off = ArrivalBursts(window=0)
    off.arrived(10)
    assert off.close_iteration() == 0
