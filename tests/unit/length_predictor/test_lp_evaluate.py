"""Evaluation metrics, the majority baseline, the table and the confusion PNG."""

from __future__ import annotations

import pytest

from length_predictor.buckets import Bucketing
from length_predictor.evaluate import bucket_metrics, confusion_png, majority_bucket, markdown_table


def test_metrics_count_exact_and_adjacent_hits():
    actual = [0, 0, 1, 2, 2, 2]
    predicted = [0, 1, 1, 0, 2, 1]
    m = bucket_metrics(predicted, actual, num_buckets=3, majority=2)
    assert m["accuracy"] == pytest.approx(3 / 6)
    assert m["within_one"] == pytest.approx(5 / 6)  # only 2 -> 0 is two buckets off
    assert m["majority_accuracy"] == pytest.approx(3 / 6)
    assert m["majority_within_one"] == pytest.approx(4 / 6)
    assert m["confusion"] == [[1, 1, 0], [0, 1, 0], [1, 1, 1]]
    assert m["label_distribution"] == pytest.approx([2 / 6, 1 / 6, 3 / 6])


def test_majority_comes_from_the_labels_given():
    assert majority_bucket([1, 1, 0, 2, 1]) == 1


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError):
        bucket_metrics([0], [0, 1], 2, 0)


def test_table_and_png(tmp_path):
    m = bucket_metrics([0, 1, 1], [0, 1, 0], num_buckets=3, majority=0)
    result = {"kind": "probe", "labels": "engine", "num_train_examples": 9, "granularity": 200,
              **m}
    table = markdown_table([result])
    assert "| probe | engine | 9 | 200 | 3 | 66.7% |" in table
    path = tmp_path / "c" / "confusion.png"
    confusion_png(m, Bucketing(200, 512), "test", path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
