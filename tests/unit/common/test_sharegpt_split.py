"""common.sharegpt's split: disjoint, de-duplicated, by conversation and stable train / eval /
bench ranges, on the packaged file and on small synthetic ones; and no benchmark prompt reaches
the predictor's dataset."""

from __future__ import annotations

import itertools

import pytest

from common.sharegpt import (
    SPLIT_RANGES,
    ShareGPTData,
    first_turns,
    load_sharegpt,
    load_split,
    normalize_prompt,
    range_of,
    record_ranges,
    split_sharegpt,
    split_sizes,
)


def _texts(pairs) -> list[str]:
    return [normalize_prompt(prompt) for _, prompt, _ in pairs]


@pytest.fixture(scope="module")
def split():
    return load_split()


@pytest.mark.parametrize("kind", ["first_turns", "all_turns"])
def test_ranges_are_disjoint_and_free_of_repeats_by_normalized_prompt(split, kind):
    texts = {name: _texts(getattr(split[name], kind)) for name in SPLIT_RANGES}
    for name, found in texts.items():
        assert len(found) == len(set(found)), f"a prompt repeats inside {name}"
    for one, other in itertools.combinations(SPLIT_RANGES, 2):
        assert not set(texts[one]) & set(texts[other]), f"{one} and {other} share prompts"


def test_no_range_opens_a_conversation_with_a_prompt_another_range_holds(split):
    # A first turn of one range is never a later turn of another: "all" mode datasets and
    # first-turn benchmarks cannot meet.
    for one, other in itertools.permutations(SPLIT_RANGES, 2):
        assert not set(_texts(split[one].first_turns)) & set(_texts(split[other].all_turns))


def test_sizes_on_the_packaged_file_are_pinned(split):
    # Pinned: a change means the assignment moved, and predictors trained before the change may
    # have seen today's benchmark prompts (common/sharegpt.py documents these numbers).
    assert split_sizes(split) == {
        "train": {"first_turns": 6161, "all_turns": 32370, "conversations": 10002},
        "eval": {"first_turns": 1535, "all_turns": 8482, "conversations": 2587},
        "bench": {"first_turns": 2574, "all_turns": 13011, "conversations": 4201}}


def test_a_conversation_never_straddles_ranges():
    data = load_sharegpt()
    split = split_sharegpt(data)  # from this very load: members are compared by identity
    ranges = record_ranges(data)
    by_conversation: dict[str, set] = {}
    for record_id, name in zip(data.record_ids, ranges):
        by_conversation.setdefault(record_id.rsplit("_", 1)[0], set()).add(name)
    assert all(len(names) == 1 for names in by_conversation.values())
    assert sum(len(names) for names in by_conversation.values()) > 9000
    for name in SPLIT_RANGES:
        members = {id(c) for c, r in zip(data.conversations, ranges) if r == name}
        assert {id(c) for c in split[name].conversations} <= members


def test_pair_indexes_point_at_the_whole_files_pairs(split):
    pairs = first_turns(load_sharegpt())
    for name in SPLIT_RANGES:
        assert all(pairs[index] == (prompt, reply)
                   for index, prompt, reply in split[name].first_turns)


def test_assignment_is_stable_across_calls_and_when_records_are_added():
    data = load_sharegpt()
    again = split_sharegpt(data)
    assert again == split_sharegpt(data) == load_split()
    half = len(data.conversations) // 2
    prefix = ShareGPTData(data.conversations[:half], half, 0, data.record_ids[:half])
    assert record_ranges(prefix) == record_ranges(data)[:half]
    smaller = split_sharegpt(prefix)
    for name in SPLIT_RANGES:
        # the second half of the file adds pairs to a range but moves none already there
        assert set(smaller[name].first_turns) <= set(again[name].first_turns)
        assert set(smaller[name].all_turns) <= set(again[name].all_turns)


def _conversation(*texts: str) -> list[dict]:
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": text}
            for i, text in enumerate(texts)]


def _key_in(name: str, stem: str) -> str:
    """A prompt that the split puts in range `name`."""
    return next(f"{stem} {i}" for i in itertools.count()
                if range_of(normalize_prompt(f"{stem} {i}")) == name)


def test_duplicates_are_dropped_keeping_the_first_and_records_follow_their_conversation():
    train, bench = _key_in("train", "question"), _key_in("bench", "question")
    again = _key_in("bench", "continue")  # would open a bench conversation
    conversations = [
        _conversation(train, "a1", again, "a2"),
        _conversation("  " + bench.upper() + "\n", "b1"),
        _conversation(bench, "b2"),  # the same prompt once normalized: dropped
        _conversation(_key_in("bench", "later piece"), "c1"),  # a piece of the first one
        _conversation(again, "d1"),  # opens with a prompt train owns (turn 2 above): dropped
    ]
    data = ShareGPTData(conversations, 5, 0, ["x_0", "y_0", "z_0", "x_3", "w_0"])
    split = split_sharegpt(data)
    assert record_ranges(data)[3] == "train"  # x_3 goes with x_0, whatever its own prompt
    assert split["train"].first_turns == [(0, train, "a1"), (3, conversations[3][0]["value"],
                                                             "c1")]
    assert split["bench"].first_turns == [(1, conversations[1][0]["value"], "b1")]
    assert [p for _, p, _ in split["train"].all_turns] == [train, again,
                                                          conversations[3][0]["value"]]
    assert record_ranges(data)[4] == "bench" and not split["bench"].all_turns[1:]
    assert conversations[2] not in split["bench"].conversations
    assert all(conversations[4] not in split[name].conversations for name in SPLIT_RANGES)


def test_benchmark_workloads_never_reach_the_predictor_dataset(default_model):
    from bench.multiturn import MultiTurnOptions, plan_conversations
    from bench.workload import sample_sharegpt_requests
    from bench.workloads import sample_workload
    from common.tokenizer import TextTokenizer
    from length_predictor.dataset import DatasetOptions, select_pairs

    tokenizer = TextTokenizer(default_model.hf_dir)
    prompts = [r.prompt for r in sample_sharegpt_requests(tokenizer, 300, 128, seed=0)]
    prompts += [r.prompt for r in sample_sharegpt_requests(
        tokenizer, 40, 64, seed=1, min_prompt_tokens=280, max_prompt_tokens=340,
        with_history=True)]
    prompts += [r.prompt for r in sample_workload(tokenizer, "Mixed", 40, seed=0)]
    prompts += [t.message for c in plan_conversations(tokenizer, 40, MultiTurnOptions(), seed=0)
                for t in c.turns]
    seen_by_predictor = set()
    for turns in ("first", "all"):
        train, held_out = select_pairs(DatasetOptions(turns=turns))
        seen_by_predictor |= set(_texts(train)) | set(_texts(held_out))
    assert len(prompts) > 400
    assert not {normalize_prompt(p) for p in prompts} & seen_by_predictor
