"""The length dataset: options, split, files on disk, reference labels from a ShareGPT file."""

from __future__ import annotations

import json

import pytest

from common.config import ConfigError, EngineConfig, ModelConfig
from common.errors import InvalidRequestError
from common.tokenizer import TextTokenizer
from length_predictor.dataset import (
    DatasetOptions,
    Example,
    build_dataset,
    load_dataset,
    split_examples,
)


def _examples(n: int) -> list[Example]:
    return [Example(i, f"p{i}", [1, 2, i], 10 * i, "stop") for i in range(n)]


def test_split_is_seeded_disjoint_and_complete():
    examples = _examples(50)
    train, held_out = split_examples(examples, 0.1, seed=3)
    assert len(held_out) == 5 and len(train) == 45
    assert {e.example_id for e in train} | {e.example_id for e in held_out} == set(range(50))
    assert not {e.example_id for e in train} & {e.example_id for e in held_out}
    again = split_examples(examples, 0.1, seed=3)
    assert [e.example_id for e in again[1]] == [e.example_id for e in held_out]
    other = split_examples(examples, 0.1, seed=4)
    assert [e.example_id for e in other[1]] != [e.example_id for e in held_out]


def test_split_keeps_one_example_on_each_side():
    train, held_out = split_examples(_examples(2), 0.9, seed=0)
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


def _write_sharegpt(path, num_records: int) -> None:
    records = [{"id": str(i), "conversations": [
        {"from": "human", "value": f"question number {i}?"},
        {"from": "gpt", "value": " ".join(["word"] * (i + 1))},
        {"from": "human", "value": f"follow-up {i}"},
        {"from": "gpt", "value": "ok"}]} for i in range(num_records)]
    text = json.dumps(records)
    path.write_text(text[:-40])  # cut inside the last record, like the packaged file


def test_reference_labels_are_reply_lengths_in_target_tokens(tmp_path, default_model):
    source = tmp_path / "sharegpt.json"
    _write_sharegpt(source, 12)
    config = EngineConfig(model=ModelConfig(path=str(default_model.hf_dir)))
    options = DatasetOptions(labels="reference", sharegpt_path=str(source), seed=1)
    metadata = build_dataset(options, config, tmp_path / "data")
    dataset = load_dataset(tmp_path / "data")
    assert metadata["num_pairs"] == 11  # the cut record is skipped
    assert len(dataset.train) + len(dataset.eval) == 11 and len(dataset.eval) == 1
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
    source = tmp_path / "sharegpt.json"
    _write_sharegpt(source, 6)
    config = EngineConfig(model=ModelConfig(path=str(default_model.hf_dir)))
    options = DatasetOptions(labels="reference", turns="all", limit=7, sharegpt_path=str(source))
    build_dataset(options, config, tmp_path / "data")
    dataset = load_dataset(tmp_path / "data")
    prompts = [e.prompt for e in dataset.train + dataset.eval]
    assert len(prompts) == 7 and any(p.startswith("follow-up") for p in prompts)


def test_prompts_with_unicode_line_separators_survive_the_files(tmp_path):
    from length_predictor.dataset import EVAL_FILE, METADATA_FILE, TRAIN_FILE, _write_jsonl

    tricky = [Example(0, "a\u2028b\x85c\rd\ne", [1, 2], 5, "stop"),
              Example(1, "plain", [3], 6, "length")]
    _write_jsonl(tmp_path / TRAIN_FILE, tricky)
    _write_jsonl(tmp_path / EVAL_FILE, tricky[:1])
    (tmp_path / METADATA_FILE).write_text(json.dumps({"max_output_tokens": 512}))
    dataset = load_dataset(tmp_path)
    assert dataset.train == tricky and dataset.eval == tricky[:1]
