"""bench.workload: seeded arrival processes and ShareGPT request sampling."""

from __future__ import annotations

import numpy as np
import pytest

from bench.workload import gamma_arrivals, poisson_arrivals, sample_sharegpt_requests
from common.tokenizer import TextTokenizer


def _gaps(offsets: list[float]) -> np.ndarray:
    return np.diff(np.asarray(offsets))


def test_poisson_is_seeded_with_the_asked_mean_rate():
    offsets = poisson_arrivals(2000, rate=4.0, seed=7)
    assert offsets == poisson_arrivals(2000, rate=4.0, seed=7)
    assert offsets != poisson_arrivals(2000, rate=4.0, seed=8)
    assert len(offsets) == 2000 and offsets[0] == 0.0
    assert all(isinstance(t, float) for t in offsets)
    gaps = _gaps(offsets)
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.1)


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_gamma_has_the_asked_mean_rate_and_cv(cv):
    offsets = gamma_arrivals(20000, rate=2.0, cv=cv, seed=3)
    assert offsets == gamma_arrivals(20000, rate=2.0, cv=cv, seed=3)
    gaps = _gaps(offsets)
    assert gaps.mean() == pytest.approx(0.5, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)


def test_infinite_rate_sends_everything_at_once():
    assert poisson_arrivals(5, float("inf"), seed=0) == [0.0] * 5
    assert gamma_arrivals(5, float("inf"), cv=3.0, seed=0) == [0.0] * 5


def test_no_arrivals_and_bad_values():
    assert poisson_arrivals(0, 1.0, seed=0) == []
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, seed=0)
    with pytest.raises(ValueError):
        gamma_arrivals(3, 1.0, cv=0.0, seed=0)


class WordTokenizer:
    """One token per word; counts calls so tests can check tokenization is lazy."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return list(range(len(text.split())))


def _pairs(count: int) -> list[tuple[str, str]]:
    # prompt i has i % 12 + 1 words, reply i has i % 50 words
    return [(" ".join(["w"] * (i % 12 + 1)), " ".join(["r"] * (i % 50))) for i in range(count)]


def test_sampling_respects_bounds_and_caps():
    requests = sample_sharegpt_requests(WordTokenizer(), 40, max_tokens=20, seed=1,
                                        max_prompt_tokens=8, min_prompt_tokens=3,
                                        pairs=_pairs(500))
    assert len(requests) == 40
    for r in requests:
        assert 3 <= r.num_prompt_tokens <= 8
        assert r.num_prompt_tokens == len(r.prompt.split())
        assert r.max_tokens == min(20, max(1, r.reference_output_tokens))
    assert any(r.reference_output_tokens > 20 for r in requests)
    assert any(r.max_tokens < 20 for r in requests)


def test_sampling_is_seeded_lazy_and_can_ignore_reference_lengths():
    tokenizer = WordTokenizer()
    first = sample_sharegpt_requests(tokenizer, 5, max_tokens=16, seed=2, pairs=_pairs(1000),
                                     use_reference_lengths=False)
    assert tokenizer.calls < 40  # only the pairs it looked at, not all 1000
    assert all(r.max_tokens == 16 for r in first)
    again = sample_sharegpt_requests(WordTokenizer(), 5, max_tokens=16, seed=2,
                                     pairs=_pairs(1000), use_reference_lengths=False)
    assert again == first
    other = sample_sharegpt_requests(WordTokenizer(), 5, max_tokens=16, seed=3,
                                     pairs=_pairs(1000), use_reference_lengths=False)
    assert other != first


def test_sampling_too_few_prompts_is_an_error():
    with pytest.raises(ValueError, match="only"):
        sample_sharegpt_requests(WordTokenizer(), 10, max_tokens=8, seed=0,
                                 max_prompt_tokens=4, min_prompt_tokens=4, pairs=_pairs(24))


def test_sampling_sharegpt_with_the_default_tokenizer(default_model):
    tokenizer = TextTokenizer(default_model.hf_dir)
    requests = sample_sharegpt_requests(tokenizer, 20, max_tokens=64, seed=0,
                                        max_prompt_tokens=256, min_prompt_tokens=8)
    assert len(requests) == 20
    assert len({r.prompt for r in requests}) == 20
    for r in requests:
        assert 8 <= r.num_prompt_tokens <= 256
        assert r.num_prompt_tokens == len(tokenizer.encode(r.prompt))
        assert 1 <= r.max_tokens <= 64
        assert r.max_tokens == min(64, max(1, r.reference_output_tokens))
