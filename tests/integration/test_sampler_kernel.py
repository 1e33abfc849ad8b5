"""The C++ sampling kernel (csrc/sampling.h): the same checks as the torch implementation's
(tests/unit/common/test_sampler.py), plus its own paths (greedy rows in the kernel, top-p by
rejection, its fallback) and its argument checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sampling_reference import (FILTERS, LOGITS, chi_square_p_value, reference_probs,
                                rows_strategy, seeded_rows_match_alone)

from common.engine import cpu_kernels
from common.engine.sampler import RowParams, Sampler
from common.sampling_params import SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernels(cache_dir):
    module = cpu_kernels.load(cache_dir)
    if module is None:
        pytest.skip("no C++ compiler: the engine samples with torch ops here")
    return module


@pytest.mark.parametrize("name", sorted(FILTERS))
def test_each_filter_samples_its_distribution(kernels, name):
    params = FILTERS[name]
    draws = 20000
    sampler = Sampler(CPU, seed=5, kernels=kernels)
    tokens = torch.tensor(sampler(LOGITS.repeat(draws, 1), [params] * draws, [0] * draws))
    assert chi_square_p_value(tokens, reference_probs(LOGITS, params)) > 1e-4


def test_low_top_p_needs_several_rejections_and_stays_exact(kernels):
    # Flat: the first proposal lands outside a 10% top-p set nine times in ten.
    logits = torch.linspace(0.0, 0.5, 12)
    params = SamplingParams(temperature=1.0, top_p=0.1)
    sampler = Sampler(CPU, seed=6, kernels=kernels)
    tokens = torch.tensor(sampler(logits.repeat(20000, 1), [params] * 20000, [0] * 20000))
    assert chi_square_p_value(tokens, reference_probs(logits, params)) > 1e-4


def test_greedy_rows_take_the_first_maximum(kernels):
    logits = torch.tensor([[0.1, 3.0, 0.2, 3.0], [5.0, 0.0, 5.0, 1.0]])
    greedy = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_k=1)]
    assert Sampler(CPU, kernels=kernels)(logits, greedy, [0, 0]) == [1, 0]
    wide = torch.randn(3, 49152)
    assert Sampler(CPU, kernels=kernels)(wide, [greedy[0]] * 3, [0] * 3) == \
        wide.argmax(-1).tolist()
    tied = torch.zeros(2, 100)
    tied[0, [17, 40, 99]] = 5.0  # ties in different vector lanes and in the tail
    tied[1, [98, 99]] = 5.0
    assert Sampler(CPU, kernels=kernels)(tied, [greedy[0]] * 2, [0] * 2) == [17, 98]


def test_masked_logits_are_never_drawn(kernels):
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.5]]).repeat(500, 1)
    tokens = Sampler(CPU, kernels=kernels)(logits, [SamplingParams(temperature=1.5)] * 500,
                                           [0] * 500)
    assert set(tokens) == {1, 3}


def test_large_vocabulary_cuts_stay_in_their_sets(kernels):
    gen = torch.Generator().manual_seed(1)
    cases = [SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=0.7,
             top_k=50), SamplingParams(temperature=1.0, min_p=0.3, top_p=0.5)]
    for scale in (4.0, 0.05):  # a peaked and a flat distribution over 49 K tokens
        logits = torch.randn(48, 49152, generator=gen) * scale
        for params in cases:
            tokens = Sampler(CPU, kernels=kernels)(logits, [params] * 48, [0] * 48)
            for row, token in enumerate(tokens):
                assert reference_probs(logits[row], params)[token] > 0, (scale, params)


@settings(max_examples=60, deadline=None)
@given(batch=rows_strategy, data_seed=st.integers(0, 1000))
def test_seeded_rows_do_not_depend_on_the_batch(kernels, batch, data_seed):
    seeded_rows_match_alone(lambda seed: Sampler(CPU, seed=seed, kernels=kernels), batch,
                            data_seed)


def test_bad_arguments_raise(kernels):
    rows = RowParams.build([0], [SamplingParams()], [0], torch.Generator())
    args = (rows.rows, rows.inv_temp, rows.top_k, rows.top_p, rows.min_p, rows.keys)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.sample_rows(torch.zeros(1, 8, dtype=torch.bfloat16), *args)
    with pytest.raises(RuntimeError, match="outside the logits"):
        kernels.sample_rows(torch.zeros(1, 8), torch.tensor([3]), *args[1:])
    with pytest.raises(RuntimeError, match="documented dtypes"):
        kernels.sample_rows(torch.zeros(1, 8), rows.rows, rows.inv_temp.double(), *args[2:])
