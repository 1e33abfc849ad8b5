"""bench.workloads: TetriInfer's LPLD/LPHD/HPLD/HPHD/Mixed classes on a synthetic corpus."""

from __future__ import annotations

import pytest

from bench.workloads import ClassThresholds, class_quotas, describe, history_pairs, sample_workload
from common.config import ConfigError

# Scaled-down thresholds: prompt > 5 words is heavy prefill, reply > 3 words is heavy decode.
LIMITS = ClassThresholds(heavy_prompt_tokens=5, heavy_output_tokens=3, max_prompt_tokens=30,
                         max_output_tokens=6, min_prompt_tokens=1)


class WordTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return list(range(len(text.split())))


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def turn(speaker: str, text: str) -> dict:
    return {"from": speaker, "value": text}


def corpus(num_each: int = 4) -> list[list[dict]]:
    """`num_each` single-round conversations per class (prompt 2 or 8 words, reply 2 or 5)."""
    conversations = []
    for prompt_words, reply_words in ((2, 2), (2, 5), (8, 2), (8, 5)):
        for i in range(num_each):
            conversations.append([turn("human", words(prompt_words, f"p{i}x")),
                                  turn("gpt", words(reply_words))])
    return conversations


def test_classes_follow_the_thresholds_and_outputs_are_fixed_reference_lengths():
    for cls in ("LPLD", "LPHD", "HPLD", "HPHD"):
        requests = sample_workload(WordTokenizer(), cls, 4, seed=0, limits=LIMITS,
                                   conversations=corpus())
        assert {r.workload_class for r in requests} == {cls}
        for r in requests:
            assert (r.num_prompt_tokens > 5) == (cls[:2] == "HP")
            assert (r.max_tokens > 3) == (cls[2:] == "HD")
            assert r.max_tokens == min(r.reference_output_tokens, 6) and not r.from_history


def test_mixed_is_an_equal_share_in_seeded_order():
    assert class_quotas("Mixed", 10) == {"LPLD": 3, "LPHD": 3, "HPLD": 2, "HPHD": 2}
    first = sample_workload(WordTokenizer(), "Mixed", 8, seed=1, limits=LIMITS,
                            conversations=corpus())
    again = sample_workload(WordTokenizer(), "Mixed", 8, seed=1, limits=LIMITS,
                            conversations=corpus())
    other = sample_workload(WordTokenizer(), "Mixed", 8, seed=2, limits=LIMITS,
                            conversations=corpus())
    assert [r.prompt for r in first] == [r.prompt for r in again]
    assert [r.prompt for r in first] != [r.prompt for r in other]
    assert {cls: d["count"] for cls, d in describe(first).items()} == \
        {"LPLD": 2, "LPHD": 2, "HPLD": 2, "HPHD": 2}


def test_phase_shift_is_decode_heavy_then_prefill_heavy_in_order():
    requests = sample_workload(WordTokenizer(), "PhaseShift", 7, seed=0, limits=LIMITS,
                               conversations=corpus())
    assert [r.workload_class for r in requests] == ["LPHD"] * 4 + ["HPLD"] * 3
    assert len({r.prompt for r in requests}) == 7


def test_heavy_prefill_is_filled_from_conversation_history_when_first_turns_run_out():
    # no first turn is heavy, but the third round of this conversation carries 3 earlier turns
    long_chat = [turn("human", words(3)), turn("gpt", words(3)), turn("human", words(3)),
                 turn("gpt", words(2, "r"))]
    conversations = [c for c in corpus() if len(c[0]["value"].split()) == 2] + [long_chat]
    requests = sample_workload(WordTokenizer(), "HPLD", 1, seed=0, limits=LIMITS,
                               conversations=conversations)
    (request,) = requests
    assert request.from_history and request.workload_class == "HPLD"
    assert request.prompt.startswith("User: w0") and "\n\nAssistant: " in request.prompt
    assert request.prompt.endswith("User: " + words(3)) and request.reference_output_tokens == 2


def test_history_pairs_yield_every_later_round():
    chat = [turn("human", "a"), turn("gpt", "b"), turn("human", "c"), turn("gpt", "d"),
            turn("human", "e"), turn("gpt", "f")]
    assert list(history_pairs([chat], seed=0)) == [
        ("User: a\n\nAssistant: b\n\nUser: c", "d"),
        ("User: a\n\nAssistant: b\n\nUser: c\n\nAssistant: d\n\nUser: e", "f")]


def test_short_texts_are_not_tokenized_when_only_heavy_classes_are_needed():
    limits = ClassThresholds(heavy_prompt_tokens=20, heavy_output_tokens=3, max_prompt_tokens=40,
                             max_output_tokens=6, min_prompt_tokens=1)
    short = [[turn("human", "a b"), turn("gpt", words(5))] for _ in range(8)]
    heavy = [[turn("human", words(25)), turn("gpt", words(5))] for _ in range(4)]
    tokenizer = WordTokenizer()
    requests = sample_workload(tokenizer, "HPHD", 4, seed=0, limits=limits,
                               conversations=short + heavy)
    assert len(requests) == 4
    # "a b" has 3 bytes, so it cannot have more than 20 tokens: only the heavy pairs are encoded
    assert tokenizer.calls == 2 * 4


def test_too_few_requests_of_a_class_is_an_error_that_says_how_many():
    with pytest.raises(ConfigError, match=r"HPHD': '4/5'"):
        sample_workload(WordTokenizer(), "HPHD", 5, seed=0, limits=LIMITS,
                        conversations=corpus())
    with pytest.raises(ConfigError):
        class_quotas("XLXD", 4)
    with pytest.raises(ConfigError):
        ClassThresholds(heavy_output_tokens=600, max_output_tokens=512)
