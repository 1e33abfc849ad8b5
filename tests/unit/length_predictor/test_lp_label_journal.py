"""The engine-label journal: resume, header check, torn last line."""

import json

import pytest

from common.errors import InvalidRequestError
from length_predictor.label_journal import LabelJournal

HEADER = {"model": None, "max_output_tokens": 512, "dtype": "bfloat16"}


def test_labels_survive_a_reopen(tmp_path):
    path = tmp_path / "journal.jsonl"
    journal = LabelJournal(path, HEADER)
    journal.record(7, 120, "stop")
    journal.record(3, 512, "length")
    journal.close()
    reopened = LabelJournal(path, HEADER)
    assert reopened.get(7) == (120, "stop")
    assert reopened.get(3) == (512, "length")
    assert reopened.get(4) is None
    assert len(reopened) == 2
    reopened.close()


def test_a_journal_from_other_settings_is_refused(tmp_path):
    path = tmp_path / "journal.jsonl"
    LabelJournal(path, HEADER).close()
    with pytest.raises(InvalidRequestError, match="delete the file"):
        LabelJournal(path, {**HEADER, "dtype": "float32"})


def test_a_torn_last_line_is_dropped_and_not_glued_to_the_next(tmp_path):
    path = tmp_path / "journal.jsonl"
    journal = LabelJournal(path, HEADER)
    journal.record(1, 10, "stop")
    journal.close()
    with open(path, "a") as handle:
        handle.write('{"id": 2, "num_outp')  # the process died mid-write
    journal = LabelJournal(path, HEADER)
    assert journal.get(2) is None
    journal.record(2, 20, "stop")
    journal.close()
    assert LabelJournal(path, HEADER).get(2) == (20, "stop")
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1]) == {"id": 2, "num_output_tokens": 20, "finish_reason": "stop"}


def test_a_file_torn_inside_the_header_starts_over(tmp_path):
    path = tmp_path / "journal.jsonl"
    path.write_text('{"head')
    journal = LabelJournal(path, HEADER)
    journal.record(5, 50, "stop")
    journal.close()
    assert json.loads(path.read_text().splitlines()[0]) == {"header": HEADER}
    assert LabelJournal(path, HEADER).get(5) == (50, "stop")
