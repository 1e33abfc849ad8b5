"""Row buckets of CPU forwards: few distinct shapes, every batch fits, little waste."""

from __future__ import annotations

from common.engine.model_runner import padded_rows


def test_small_counts_round_to_powers_of_two():
    assert [padded_rows(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]


def test_buckets_cover_every_count_with_bounded_waste():
    for n in range(1, 4097):
        padded = padded_rows(n)
        assert padded >= n
        assert padded - n < (8 if n <= 256 else 64)


def test_bucket_count_is_small():
    assert len({padded_rows(n) for n in range(1, 129)}) == 19  # 1, 2, 4, 8, 16, ..., 128
    assert len({padded_rows(n) for n in range(1, 2049)}) == 3 + 32 + 28
