"""The length dataset: options, pairs from the split's train/eval ranges, files on disk, reference
labels from a ShareGPT file."""

from __future__ import annotations

import json

import pytest

from common.config import ConfigError, EngineConfig, ModelConfig
from common.errors import InvalidRequestError
from common.tokenizer import TextTokenizer
from common.sharegpt import load_split
from length_predictor.dataset import (
    DatasetOptions,
    Example,
    build_dataset,
    load_dataset,
    select_pairs,
)

NUM_RECORDS = 60  # enough for every range of the split to hold a few (checked below)


def _ids(pairs) -> list[int]:
    return [index for index, _, _ in pairs]


def test_pairs_come_from_the_train_and_eval_ranges_in_seeded_order(tmp_path):
    source = _write_sharegpt(tmp_path / "sharegpt.json", NUM_RECORDS)
    split = load_split(source)
    assert all(len(split[name].first_turns) >= 5 for name in ("train", "eval", "bench"))
    train, held_out = select_pairs(DatasetOptions(sharegpt_path=str(source), seed=3))
    assert sorted(_ids(train)) == _ids(split["train"].first_turns)
    assert sorted(_ids(held_out)) == _ids(split["eval"].first_turns)
    again = select_pairs(DatasetOptions(sharegpt_path=str(source), seed=3))
    other = select_pairs(DatasetOptions(sharegpt_path=str(source), seed=4))
    assert again == (train, held_out)
    # Another seed orders each range differently but never moves a pair to another range.
    assert _ids(other[0]) != _ids(train) and sorted(_ids(other[0])) == sorted(_ids(train))


def test_a_limit_takes_its_eval_share_and_a_prefix_of_each_range(tmp_path):
    source = _write_sharegpt(tmp_path / "sharegpt.json", NUM_RECORDS)
    whole = select_pairs(DatasetOptions(sharegpt_path=str(source)))
    train, held_out = select_pairs(DatasetOptions(sharegpt_path=str(source), limit=10))
    assert (len(train), len(held_out)) == (8, 2)  # the ranges' ratio: 0.15 / 0.75 = 0.2
    assert train == whole[0][:8] and held_out == whole[1][:2]
    train, held_out = select_pairs(DatasetOptions(sharegpt_path=str(source), limit=2,
                                                  eval_fraction=0.9))
    assert len(train) == 1 and len(held_out) == 1


def test_example_json_round_trip():
    example = Example(7, "héllo", [1, 2, 3], 42, "length")
    record = json.loads(example.to_json())
    assert record["num_prompt_tokens"] == 3 and record["num_output_tokens"] == 42
    assert Example.from_json(example.to_json()) == example


@pytest.mark.parametrize("changes, message", [
    ({"labels": "gold"}, "labels must be one of"), ({"turns": "last"}, "turns must be"),
    ({"limit": 1}, "limit must be at least 2"), ({"eval_fraction": 1.0}, "eval fraction"),
    ({"max_output_tokens": 0}, "max output tokens")])
def test_bad_options_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        DatasetOptions(**changes)


def test_missing_dataset_dir_is_one_line_error(tmp_path):
    with pytest.raises(InvalidRequestError, match="not a length dataset"):
        load_dataset(tmp_path / "nope")


def _write_sharegpt(path, num_records: int):
    records = [{"id": str(i), "conversations": [
        {"from": "human", "value": f"question number {i}?"},
        {"from": "gpt", "value": " ".join(["word"] * (i + 1))},
        {"from": "human", "value": f"follow-up {i}"},
        {"from": "gpt", "value": "ok"}]} for i in range(num_records)]
    text = json.dumps(records)
    path.write_text(text[:-40])  # cut inside the last record, like the packaged file
    return path


def test_reference_labels_are_reply_lengths_in_target_tokens(tmp_path, default_model):
    source = _write_sharegpt(tmp_path / "sharegpt.json", NUM_RECORDS)
    config = EngineConfig(model=ModelConfig(path=str(default_model.hf_dir)))
    options = DatasetOptions(labels="reference", sharegpt_path=str(source), seed=1)
    metadata = build_dataset(options, config, tmp_path / "data")
    dataset = load_dataset(tmp_path / "data")
    split = load_split(source)
    # Every complete record (the cut one is skipped) of the train and eval ranges, none of bench.
    assert sorted(e.example_id for e in dataset.train) == _ids(split["train"].first_turns)
    assert sorted(e.example_id for e in dataset.eval) == _ids(split["eval"].first_turns)
    assert metadata["num_pairs"] == len(dataset.train) + len(dataset.eval) \
        == NUM_RECORDS - 1 - len(split["bench"].first_turns)
    tokenizer = TextTokenizer(default_model.hf_dir)
    for example in dataset.train + dataset.eval:
        i = example.example_id
        assert example.prompt == f"question number {i}?"
        assert example.num_output_tokens == len(tokenizer.encode(
            " ".join(["word"] * (i + 1)), add_special_tokens=False))
        assert example.prompt_token_ids == tokenizer.encode_chat(
            [{"role": "user", "content": example.prompt}])
    assert dataset.metadata["labels"] == "reference" and dataset.max_output_tokens == 512


def test_all_turns_and_limit(tmp_path, default_model):
    source = _write_sharegpt(tmp_path / "sharegpt.json", NUM_RECORDS)
    config = EngineConfig(model=ModelConfig(path=str(default_model.hf_dir)))
    options = DatasetOptions(labels="reference", turns="all", limit=7, sharegpt_path=str(source))
    build_dataset(options, config, tmp_path / "data")
    dataset = load_dataset(tmp_path / "data")
    prompts = [e.prompt for e in dataset.train + dataset.eval]
    assert len(prompts) == 7 and any(p.startswith("follow-up") for p in prompts)
    assert len(dataset.eval) == 1  # round(7 * 0.2)


def test_prompts_with_unicode_line_separators_survive_the_files(tmp_path):
    from length_predictor.dataset import EVAL_FILE, METADATA_FILE, TRAIN_FILE, _write_jsonl

    tricky = [Example(0, "a\u2028b\x85c\rd\ne", [1, 2], 5, "stop"),
              Example(1, "plain", [3], 6, "length")]
    _write_jsonl(tmp_path / TRAIN_FILE, tricky)
    _write_jsonl(tmp_path / EVAL_FILE, tricky[:1])
    (tmp_path / METADATA_FILE).write_text(json.dumps({"max_output_tokens": 512}))
    dataset = load_dataset(tmp_path)
    assert dataset.train == tricky and dataset.eval == tricky[:1]
