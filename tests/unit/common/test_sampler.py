"""Sampler (torch implementation): greedy, each filter's distribution (chi-square), seeds that
make sampling independent of batching. The C++ kernel passes the same checks in
tests/integration/test_sampler_kernel.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sampling_reference import (FILTERS, LOGITS, chi_square_p_value, reference_probs,
                                rows_strategy, seeded_rows_match_alone)

from common.engine.sampler import RowParams, Sampler, sample_torch, token_seed, uniform
from common.sampling_params import SamplingParams

CPU = torch.device("cpu")


def test_greedy_is_argmax_first_of_ties():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 5.0]])
    assert Sampler(CPU)(logits, [SamplingParams(temperature=0)] * 2, [0, 0]) == [1, 0]


def test_uniform_is_in_range_and_depends_on_key_and_draw():
    values = {uniform(token_seed(7, i), d) for i in range(50) for d in range(3)}
    assert len(values) == 150 and all(0.0 <= v < 1.0 for v in values)


@pytest.mark.parametrize("name", sorted(FILTERS))
def test_each_filter_samples_its_distribution(name):
    params = FILTERS[name]
    draws = 20000
    tokens = torch.tensor(Sampler(CPU, seed=3)(LOGITS.repeat(draws, 1), [params] * draws,
                                               [0] * draws))
    assert chi_square_p_value(tokens, reference_probs(LOGITS, params)) > 1e-4


def test_filters_cut_the_expected_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    cases = [(SamplingParams(top_k=2), [1, 1, 0, 0]), (SamplingParams(top_p=0.7), [1, 1, 0, 0]),
             (SamplingParams(top_p=0.81), [1, 1, 1, 0]), (SamplingParams(min_p=0.5), [1, 1, 0, 0]),
             (SamplingParams(top_p=1.0), [1, 1, 1, 1])]
    for params, support in cases:
        assert (reference_probs(logits[0], params) > 0).int().tolist() == support
        tokens = Sampler(CPU)(logits.repeat(400, 1), [params] * 400, [0] * 400)
        assert {t for t in tokens} == {i for i, s in enumerate(support) if s}


def test_masked_logits_are_never_drawn():
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.5]]).repeat(500, 1)
    tokens = Sampler(CPU)(logits, [SamplingParams(temperature=1.5)] * 500, [0] * 500)
    assert set(tokens) == {1, 3}


def test_large_vocabulary_top_p_stays_in_the_set():
    gen = torch.Generator().manual_seed(0)
    for scale in (4.0, 0.05):  # a peaked and a flat distribution over 49 K tokens
        logits = torch.randn(64, 49152, generator=gen) * scale
        params = SamplingParams(temperature=0.7, top_p=0.95)
        tokens = Sampler(CPU)(logits, [params] * 64, [0] * 64)
        for row, token in enumerate(tokens):
            assert reference_probs(logits[row], params)[token] > 0


@settings(max_examples=60, deadline=None)
@given(batch=rows_strategy, data_seed=st.integers(0, 1000))
def test_seeded_rows_do_not_depend_on_the_batch(batch, data_seed):
    seeded_rows_match_alone(lambda seed: Sampler(CPU, seed=seed), batch, data_seed)


def test_torch_implementation_takes_the_row_params():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    rows = RowParams.build([0, 1, 2], params, [0, 0, 0], torch.Generator())
    first = sample_torch(logits, rows)
    assert torch.equal(first, sample_torch(logits, rows))
    assert first.dtype == torch.long and first.shape == (3,)
