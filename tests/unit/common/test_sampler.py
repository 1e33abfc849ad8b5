"""Sampler: greedy, filters, and seeds that make sampling independent of batching."""

from __future__ import annotations

import torch

from common.engine.sampler import Sampler, _filter_top_k, _filter_top_p
from common.sampling_params import SamplingParams


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    assert Sampler(torch.device("cpu"))(logits, [SamplingParams(temperature=0)] * 2, [0, 0]) == \
        [1, 0]


def test_seeded_sampling_depends_only_on_seed_and_index():
    logits = torch.randn(1, 1000)
    p = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0)
    a = Sampler(torch.device("cpu"), seed=1)(logits, [p], [5])
    b = Sampler(torch.device("cpu"), seed=2)(torch.cat([torch.randn(1, 1000), logits]),
                                             [other, p], [0, 5])
    assert a[0] == b[1]
    draws = {Sampler(torch.device("cpu"))(logits, [p], [i])[0] for i in range(20)}
    assert len(draws) > 1, "different token indices must draw different noise"


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept_k = torch.isfinite(_filter_top_k(logits, [2]))
    assert kept_k.tolist() == [[True, True, False, False]]
    kept_p = torch.isfinite(_filter_top_p(logits, [0.7]))
    assert kept_p.tolist() == [[True, True, False, False]]
    kept_all = torch.isfinite(_filter_top_p(logits, [1.0]))
    assert kept_all.all()


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log().repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens = torch.tensor(Sampler(torch.device("cpu"), seed=0)(logits, params, [0] * 4000))
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    top1 = Sampler(torch.device("cpu"))(logits[:50], [SamplingParams(top_k=1)] * 50, [0] * 50)
    assert set(top1) == {0}
