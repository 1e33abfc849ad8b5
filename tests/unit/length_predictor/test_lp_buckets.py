"""Length buckets, granularity parsing and prompt cutting (pure Python)."""

from __future__ import annotations

import pytest

from common.config import ConfigError
from common.protocol import LengthPrediction
from length_predictor.base import cut_prompt
from length_predictor.buckets import Bucketing, parse_granularities


def test_buckets_cover_g_wide_ranges_and_cap_at_max_output_tokens():
    b = Bucketing(200, 512)
    assert b.num_buckets == 3
    assert [b.bucket(n) for n in (0, 199, 200, 399, 400, 512, 5000)] == [0, 0, 1, 1, 2, 2, 2]
    assert b.prediction(0) == LengthPrediction(0, 0, 200)
    assert b.prediction(2) == LengthPrediction(2, 400, 512)  # last bucket ends at the cap


def test_a_cap_divisible_by_g_gets_its_own_bucket_for_capped_lengths():
    b = Bucketing(100, 400)
    assert b.num_buckets == 5
    assert b.bucket(399) == 3 and b.bucket(400) == 4
    assert b.prediction(4) == LengthPrediction(4, 400, 400)


@pytest.mark.parametrize("g, cap, expected", [(100, 512, 6), (200, 512, 3), (400, 512, 2)])
def test_paper_granularities_at_the_default_cap(g, cap, expected):
    assert Bucketing(g, cap).num_buckets == expected


def test_every_length_falls_in_the_bounds_of_its_bucket():
    b = Bucketing(100, 512)
    for n in range(512):
        p = b.prediction(b.bucket(n))
        assert p.lower <= n < p.upper or (n == 512 and p.upper == 512)


def test_bad_bucketing_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="granularity must be > 0"):
        Bucketing(0, 512)
    with pytest.raises(ConfigError, match="above the length cap"):
        Bucketing(600, 512)
    with pytest.raises(ValueError):
        Bucketing(200, 512).prediction(3)


def test_parse_granularities():
    assert parse_granularities("100,200,400") == (100, 200, 400)
    assert parse_granularities("200") == (200,)
    for bad in ("", "abc", "100,-5", "200,200", "0"):
        with pytest.raises(ConfigError):
            parse_granularities(bad)


def test_cut_prompt_keeps_head_and_tail():
    prompt = list(range(1000))
    cut = cut_prompt(prompt, 512)
    assert len(cut) == 512
    assert cut[:256] == list(range(256)) and cut[256:] == list(range(744, 1000))
    assert cut_prompt([1, 2, 3], 512) == [1, 2, 3]
    assert cut_prompt(list(range(7)), 3) == [0, 5, 6]
