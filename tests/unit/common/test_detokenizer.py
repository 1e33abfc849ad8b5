"""Incremental detokenization and stop strings against the default model's real tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.detokenizer import IncrementalDetokenizer, StopStringMatcher
from common.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return TextTokenizer(default_model.hf_dir)


def stream(tokenizer, ids, step=1):
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    return pieces, detok.flush()


@pytest.mark.parametrize("text", ["héllo wörld", "日本の首都は東京です", "emoji 🎉🚀 done",
                                  "mixed ΑΒΓ and 한국어 text", "  spaces\n\ttabs  "])
def test_stream_equals_full_decode_for_multibyte_text(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces, tail = stream(tokenizer, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces), "no half characters are ever emitted"


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), min_size=1, max_size=40),
       step=st.integers(min_value=1, max_value=4))
def test_stream_equals_full_decode_for_any_tokens(tokenizer, ids, step):
    pieces, tail = stream(tokenizer, ids, step)
    assert "".join(pieces) + tail == tokenizer.decode(ids)


def test_chat_template_matches_transformers(tokenizer, default_model):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(default_model.hf_dir))
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "What is 2+2?"}]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.apply_chat_template(messages) == expected
    assert tokenizer.encode_chat(messages) == reference(expected, add_special_tokens=False
                                                        ).input_ids
    assert tokenizer.encode("plain text") == reference("plain text").input_ids
    assert 2 in tokenizer.eos_token_ids


def test_stop_strings_cut_and_hold_back():
    m = StopStringMatcher(("STOP", "\n\n"))
    out = m.push("Hello ST")
    assert out == "Hello "  # "ST" might start "STOP"
    out += m.push("ill going")
    assert out == "Hello STill going"
    out += m.push(" now\n")
    out += m.push("\nafter")
    assert out == "Hello STill going now" and m.stopped
    assert m.push("more") == "" and m.finish() == ""


def test_stop_string_spanning_pushes_and_finish_releases_tail():
    m = StopStringMatcher(("<end>",))
    assert m.push("abc<e") == "abc"
    assert m.push("n") == ""
    assert m.finish() == "<en"
    m2 = StopStringMatcher(("<end>",))
    assert m2.push("abc<e") + m2.push("nd>tail") == "abc" and m2.stopped
