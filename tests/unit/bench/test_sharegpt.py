"""common.sharegpt: reading truncated ShareGPT files and picking (human, gpt) turn pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import SplitserveError
from common.sharegpt import ShareGPTData, all_turns, first_turns, load_sharegpt


def _conv(*turns: tuple[str, str]) -> list[dict]:
    return [{"from": who, "value": text} for who, text in turns]


def _record(rid: str, *turns: tuple[str, str]) -> dict:
    return {"id": rid, "conversations": _conv(*turns)}


def _write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, str):
        text = text.encode("utf-8")
    path.write_bytes(text)
    return path


def _truncated_file(tmp_path: Path) -> Path:
    records = [_record(str(i), ("human", f"question {i}"), ("gpt", f"answer {i}"))
               for i in range(4)]
    full = json.dumps(records, indent=2)
    # Cut inside the 4th record's text, as the packaged file is cut.
    cut = full.index("answer 3") + 3
    return _write(tmp_path / "cut.json", full[:cut])


def test_truncated_tail_is_one_skipped_record(tmp_path):
    data = load_sharegpt(_truncated_file(tmp_path))
    assert data.num_complete == 3
    assert data.num_skipped == 1
    assert [c[0]["value"] for c in data.conversations] == ["question 0", "question 1",
                                                           "question 2"]


def test_complete_array_skips_nothing(tmp_path):
    records = [_record("a", ("human", "hi"), ("gpt", "hello"))] * 2
    data = load_sharegpt(_write(tmp_path / "full.json", json.dumps(records)))
    assert (data.num_complete, data.num_skipped) == (2, 0)


def test_cut_between_records_counts_the_missing_rest(tmp_path):
    record = json.dumps(_record("a", ("human", "hi"), ("gpt", "hello")))
    data = load_sharegpt(_write(tmp_path / "cut.json", f"[{record},\n  "))
    assert (data.num_complete, data.num_skipped) == (1, 1)


def test_records_without_a_conversation_list_are_skipped(tmp_path):
    good = _record("ok", ("human", "hi"), ("gpt", "hello"))
    elements = [1, "text", None, [good], {"id": "no-conversations"},
                {"id": "x", "conversations": "not a list"}, good]
    data = load_sharegpt(_write(tmp_path / "mixed.json", json.dumps(elements)))
    assert (data.num_complete, data.num_skipped) == (1, 6)


def test_character_cut_by_truncation_does_not_fail(tmp_path):
    good = json.dumps(_record("a", ("human", "café"), ("gpt", "ok")), ensure_ascii=False)
    tail = '{"id": "b", "conversations": [{"from": "human", "value": "é'.encode()
    raw = f"[{good}, ".encode() + tail[:-1]  # ends with half of the 2-byte é
    data = load_sharegpt(_write(tmp_path / "utf8.json", raw))
    assert (data.num_complete, data.num_skipped) == (1, 1)
    assert data.conversations[0][0]["value"] == "café"


def test_not_an_array_is_an_error(tmp_path):
    with pytest.raises(SplitserveError, match="JSON array"):
        load_sharegpt(_write(tmp_path / "object.json", '{"conversations": []}'))


def test_parsed_file_is_cached_per_path(tmp_path):
    path = _truncated_file(tmp_path)
    assert load_sharegpt(path) is load_sharegpt(str(path))


def _data(*conversations: list[dict]) -> ShareGPTData:
    return ShareGPTData(conversations=list(conversations), num_complete=len(conversations),
                        num_skipped=0)


def test_first_turns_keeps_only_conversations_opening_with_human_then_gpt():
    data = _data(
        _conv(("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2")),
        _conv(("gpt", "hi"), ("human", "q"), ("gpt", "a")),
        _conv(("human", "q"), ("gpt", "  ")),
        _conv(("human", ""), ("gpt", "a")),
        _conv(("human", "q")),
        _conv(("human", "q"), ("human", "q again"), ("gpt", "a")),
        _conv(("system", "s"), ("human", "q"), ("gpt", "a")),
        [],
        ["not a dict", {"from": "gpt", "value": "a"}],
        [{"from": "human", "value": 3}, {"from": "gpt", "value": "a"}],
    )
    assert first_turns(data) == [("q1", "a1")]


def test_all_turns_gives_every_human_gpt_pair():
    data = _data(
        _conv(("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2")),
        _conv(("gpt", "hi"), ("human", "q3"), ("gpt", "a3"), ("human", "q4")),
        _conv(("human", "q5"), ("human", "q6"), ("gpt", "a6")),
    )
    assert all_turns(data) == [("q1", "a1"), ("q2", "a2"), ("q3", "a3"), ("q6", "a6")]


def test_packaged_file_reads_every_complete_record():
    data = load_sharegpt()
    assert 17000 <= data.num_complete <= 18500
    assert data.num_skipped >= 1
    pairs = first_turns(data)
    assert len(pairs) > 10000
    assert all(prompt.strip() and reply.strip() for prompt, reply in pairs)
