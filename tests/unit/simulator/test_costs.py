"""The cost model: the forward-time formula, the fit to a profile record, files, hardware."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from common.config import ConfigError
from common.plan import BatchPlan, ScheduledChunk
from common.sampling_params import SamplingParams
from simulator import costs as cost_files
from simulator.costs import DECODE_BATCHES, PREFILL_SIZES, Link
from simulator.fit import fit_profile
from simulator.hardware import hardware_costs

from unit.simulator.sim_fixtures import COSTS

ROOT = Path(__file__).resolve().parents[3]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def chunk(n: int, cached: int, samples: bool) -> ScheduledChunk:
    return ScheduledChunk(f"s{n}-{cached}", [5] * n, cached, [], GREEDY if samples else None)


def test_a_forward_costs_its_tokens_rows_context_and_pairs():
    plan = BatchPlan([chunk(64, 0, False), chunk(36, 64, True), chunk(1, 200, True)],
                     num_padding_tokens=3)
    tokens = 64 + 36 + 1 + 3
    expected = (0.010 + 0.0001 * (tokens - 1) + 2 * 0.001 + 1e-6 * (64 + 200)
                + 1e-8 * (64 * 36 + 200 * 1))
    assert COSTS.forward_s(plan) == pytest.approx(expected)
    swaps = BatchPlan([chunk(1, 10, True)], swap_out=[(1, 2), (3, 4)], swap_in=[(5, 6)])
    with_swap = replace(COSTS, swap_bytes_per_s=16_000.0)
    # three blocks of 16 tokens x 1000 bytes at 16 kB/s: 3 s on top of the forward
    assert with_swap.forward_s(swaps, block_size=16) == pytest.approx(COSTS.forward_s(swaps) + 3)


def test_the_helpers_agree_with_the_formula():
    assert COSTS.prefill_s(100) == pytest.approx(COSTS.forward_s(BatchPlan([chunk(100, 0, True)])))
    decode = BatchPlan([chunk(1, 300, True) for _ in range(8)])
    assert COSTS.decode_step_s(8, 300) == pytest.approx(COSTS.forward_s(decode))
    curves = COSTS.iteration_costs()
    assert curves.forward_s(512) == pytest.approx(COSTS.prefill_s(512))
    assert curves.decode_step_s(32) == pytest.approx(COSTS.decode_step_s(32, 256))
    assert Link(1e6, 0.002).transfer_s(5000) == pytest.approx(0.007)
    assert COSTS.transfer_s(Link(1e6, 0.002), 5) == pytest.approx(0.007)


def test_a_mixed_forward_pays_the_mixed_constant_once():
    mixed_costs = replace(COSTS, per_mixed_forward_s=0.05)
    prompt, decode = chunk(300, 0, True), chunk(1, 200, True)
    for plan in (BatchPlan([prompt]), BatchPlan([decode, chunk(1, 90, True)]),
                 BatchPlan([prompt, chunk(20, 40, False)])):  # no decode: no mixed cost
        assert mixed_costs.forward_s(plan) == pytest.approx(COSTS.forward_s(plan))
    mixed = BatchPlan([prompt] + [chunk(1, 200, True) for _ in range(4)])
    assert mixed_costs.forward_s(mixed) == pytest.approx(COSTS.forward_s(mixed) + 0.05)
    assert mixed_costs.mixed_s(300, 4, 200) == pytest.approx(mixed_costs.forward_s(mixed))
    assert mixed_costs.scaled(2.0).per_mixed_forward_s == pytest.approx(0.1)


def roofline_record(a=0.01, b=1e-4, pair=1e-8, row=1e-3, ctx=2e-6, context=256,
                    mix: float | None = None, extra: float | None = None) -> dict:
    """A profile record made from known coefficients (weights-bound below 100 tokens); with
    `mix`, mixed rows whose forwards cost that much beyond their parts; with `extra`, decode
    rows at other contexts and multi-prompt rows whose every prompt after the first costs that
    much (each prompt attending only to itself)."""
    def fresh(n):
        return max(a, b * n) + pair * n * (n + 1) / 2

    def decode(b_):
        return b_ * row + b_ * context * (ctx + pair)

    record = {"model": "made-up", "dtype": "float32", "threads": 1, "decode_context": context,
              "recommended_chunk_size": 128,
              "prefill": [{"tokens": n, "seconds": fresh(n) + row} for n in PREFILL_SIZES],
              "decode": [{"batch": b_, "step_seconds": fresh(b_) + decode(b_)}
                         for b_ in DECODE_BATCHES]}
    if mix is not None:
        record["mixed"] = [{"prefill_tokens": n, "batch": b_, "context": context,
                            "seconds": fresh(n + b_) + row + decode(b_) + mix}
                           for n in (256, 1024) for b_ in (1, 16)]
    if extra is not None:
        record["decode_contexts"] = [
            {"batch": b_, "context": c, "step_seconds": fresh(b_) + b_ * row
             + b_ * c * (ctx + pair)} for b_, c in ((1, 64), (8, 64), (8, 1024), (32, 1024))]
        record["multi_prompt"] = [
            {"prompts": k, "tokens": n, "seconds": max(a, b * k * n)
             + k * pair * n * (n + 1) / 2 + k * row + extra * (k - 1)}
            for k, n in ((2, 16), (4, 16), (8, 16), (2, 64), (4, 64), (8, 64), (2, 256))]
    return record


def test_the_fit_recovers_known_coefficients():
    model = fit_profile(roofline_record(), kv_bytes=1000)
    assert model.per_context_pair_s == pytest.approx(1e-8, rel=1e-3)
    assert model.per_sampled_row_s == pytest.approx(1e-3, rel=0.05)
    assert model.per_context_token_s == pytest.approx(2e-6, rel=0.05)
    assert model.fit["max_abs_relative_error"]["prefill"] < 0.01
    assert model.fit["max_abs_relative_error"]["decode"] < 0.02
    assert model.chunk_size == 128 and model.kv_bytes_per_token == 1000


def test_the_fit_recovers_the_mixed_constant_from_mixed_rows():
    model = fit_profile(roofline_record(mix=0.02), kv_bytes=1000)
    assert model.per_mixed_forward_s == pytest.approx(0.02, rel=0.1)
    assert model.per_sampled_row_s == pytest.approx(1e-3, rel=0.05)
    assert model.fit["max_abs_relative_error"]["mixed"] < 0.02
    assert any("mixed forwards measured (4 rows)" in note for note in model.notes)
    assert [r["kind"] for r in model.fit["rows"]].count("mixed") == 4
    without = fit_profile(roofline_record(), kv_bytes=1000)
    assert without.per_mixed_forward_s == 0.0
    assert "mixed" not in without.fit["max_abs_relative_error"]
    assert any("modelled, not measured" in note for note in without.notes)


def test_the_fit_of_a_real_cpu_profile_is_close_and_states_its_limits():
    record = json.loads((ROOT / "docs/benchmarks/profile-cpu-zen4-s5/profile.json").read_text())
    model = fit_profile(record, source="zen4")
    ys = [y for _, y in model.base]
    assert ys == sorted(ys) and min(model.per_sampled_row_s, model.per_context_token_s) >= 0
    assert model.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2  # SmolLM2-135M in bfloat16
    assert max(model.fit["max_abs_relative_error"].values()) < 0.25
    assert any("confounded with the per-row cost" in note for note in model.notes)
    with pytest.raises(ConfigError, match="KV bytes per token"):
        fit_profile({**record, "model": "unknown"})


def test_a_cost_model_file_round_trips_and_a_profile_record_is_not_one(tmp_path):
    model = fit_profile(roofline_record(), kv_bytes=1000)
    assert cost_files.load(model.save(tmp_path / "m.json")) == model
    (tmp_path / "record.json").write_text(json.dumps(roofline_record()))
    with pytest.raises(ConfigError, match="not a simulator cost model"):
        cost_files.load(tmp_path / "record.json")


def test_the_gpu_model_is_labelled_as_published_figures():
    model = hardware_costs("h100-llama2-7b")
    assert model.source.startswith("PUBLISHED FIGURES")
    assert model.kv_bytes_per_token == 524_288
    # a decode step at batch 1 streams the 13.48 GB of weights at 80% of 3.35 TB/s, plus 1 ms
    assert model.decode_step_s(1, 0) == pytest.approx(1e-3 + 13.48e9 / 2.68e12 + 5e-6, rel=1e-3)
    assert 100_000 < model.kv_capacity_tokens < 110_000
    with pytest.raises(ConfigError, match="unknown hardware"):
        hardware_costs("tpu")


def test_several_fresh_prompts_cost_their_matmuls_their_own_pairs_and_the_extra_prompts():
    costs = replace(COSTS, per_extra_prompt_s=0.003)
    four = BatchPlan([replace(chunk(64, 0, True), seq_id=f"p{i}") for i in range(4)])
    crossing = 256 * 257 / 2 - 4 * 64 * 65 / 2  # pairs across the prompts: none computes them
    expected = costs.base_s(256) + 4 * costs.per_sampled_row_s \
        - costs.per_context_pair_s * crossing + 3 * 0.003
    assert costs.forward_s(four) == pytest.approx(expected)
    assert costs.multi_prompt_s(4, 64) == pytest.approx(costs.forward_s(four))
    assert costs.multi_prompt_s(1, 64) == pytest.approx(costs.prefill_s(64))
    # one fresh prompt, with decodes or a later chunk of another prompt: neither term
    for plan in (BatchPlan([chunk(64, 0, True), chunk(1, 90, True)]),
                 BatchPlan([chunk(64, 0, True), chunk(20, 40, False)])):
        assert costs.forward_s(plan) == pytest.approx(COSTS.forward_s(plan))
    assert costs.scaled(2.0).per_extra_prompt_s == pytest.approx(0.006)
    # a pair cost far too high cannot price the forward below its longest prompt alone
    steep = replace(COSTS, per_context_pair_s=1.0)
    two = BatchPlan([chunk(100, 0, True), replace(chunk(30, 0, True), seq_id="q")])
    assert steep.forward_s(two) == pytest.approx(steep.base_s(100) + 2 * steep.per_sampled_row_s)


def test_the_fit_recovers_the_extra_prompt_cost_and_context_rows_separate_the_context():
    model = fit_profile(roofline_record(extra=0.004), kv_bytes=1000)
    assert model.per_extra_prompt_s == pytest.approx(0.004, rel=0.1)
    assert model.per_context_token_s == pytest.approx(2e-6, rel=0.05)
    assert model.fit["max_abs_relative_error"]["multi_prompt"] < 0.02
    assert [r["kind"] for r in model.fit["rows"]].count("multi_prompt") == 7
    assert any("several fresh prompts measured (7 rows)" in note for note in model.notes)
    assert any("contexts [64, 256, 1024]" in note and "confounded" not in note
               for note in model.notes)
    without = fit_profile(roofline_record(), kv_bytes=1000)
    assert without.per_extra_prompt_s == 0.0 and "multi_prompt" not in without.fit[
        "max_abs_relative_error"]
