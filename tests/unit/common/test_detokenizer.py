"""Incremental detokenization and stop strings against the default model's real tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.detokenizer import IncrementalDetokenizer, StopStringMatcher, TextStream
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


def test_text_pushed_unchecked_never_stops_but_a_match_ending_later_does():
    m = StopStringMatcher(("STOP", "ab"))
    assert m.push("xx STOP ab", check=False) == "xx STOP ab" and not m.stopped
    assert m.push(" more") == " more" and not m.stopped  # the old matches stay unmatched
    m2 = StopStringMatcher(("STOP",))
    assert m2.push("xx ST", check=False) == "xx "  # "ST" is held back all the same
    assert m2.push("OP tail") == "" and m2.stopped  # a match ending in checked text stops


def test_min_tokens_keeps_stop_strings_from_stopping_the_first_tokens(tokenizer):
    ids = tokenizer.encode("one two one two one two")
    word = tokenizer.encode(" two")
    assert len(word) == 1 and ids.count(word[0]) == 3
    cut_at = [i for i, t in enumerate(ids) if t == word[0]]  # positions of " two"

    def run(min_tokens):
        text = TextStream(tokenizer, (" two",), min_tokens)
        out = ""
        for i in range(0, len(ids), 2):  # updates of two tokens: arming happens mid-update
            out += text.push(ids[i:i + 2], False)
            if text.stopped:
                return out, i
        return out + text.push([], True), None

    assert run(0)[0] == "one"  # the first " two" stops
    # below min_tokens the first " two" (token 2) is not checked; the second (token 4) stops
    assert run(cut_at[0] + 1)[0] == "one"  # min_tokens = 2: token 2 is already checked
    assert run(cut_at[0] + 2)[0] == "one two one"
    assert run(len(ids))[0] == "one two one two one"  # the last token is the first checked
    assert run(len(ids) + 1)[0] == "one two one two one two"  # none checked
