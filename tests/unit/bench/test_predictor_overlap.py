"""The E12 runs: a predictor must never have seen the workload it is measured on, and the
chosen (lengths, admission) runs."""

from __future__ import annotations

import json

import pytest

from bench.decode_experiments import predictor_overlap
from bench.workload import BenchRequest
from common.config import ConfigError


def _predictor(tmp_path, train: list[str], eval_: list[str]) -> str:
    dataset = tmp_path / "data"
    dataset.mkdir()
    for name, prompts in (("train", train), ("eval", eval_)):
        (dataset / f"{name}.jsonl").write_text(
            "".join(json.dumps({"prompt": p, "output_tokens": 3}) + "\n" for p in prompts))
    predictor = tmp_path / "probe"
    predictor.mkdir()
    (predictor / "predictor.json").write_text(json.dumps(
        {"kind": "probe", "granularity": 100, "max_output_tokens": 256, "dataset": str(dataset)}))
    return str(predictor)


def _requests(*prompts: str) -> list[BenchRequest]:
    return [BenchRequest(p, 4, 16, 16) for p in prompts]


def test_a_disjoint_workload_is_recorded_as_checked(tmp_path):
    predictor = _predictor(tmp_path, ["write a poem", "sum 2 and 2"], ["hello there"])
    out = predictor_overlap(predictor, _requests("translate this", "tell me a joke"))
    assert out["checked"] and out["workload_prompts_seen"] == 0 and out["dataset_prompts"] == 3


@pytest.mark.parametrize("seen", ["Write a   poem", "HELLO there"])  # train or eval, normalized
def test_a_workload_prompt_from_the_dataset_is_refused(tmp_path, seen):
    predictor = _predictor(tmp_path, ["write a poem", "sum 2 and 2"], ["hello there"])
    with pytest.raises(ConfigError, match="1 of the 2 workload prompts"):
        predictor_overlap(predictor, _requests("translate this", seen))


def test_a_dataset_that_is_gone_is_reported_unchecked(tmp_path):
    predictor = _predictor(tmp_path, ["a"], ["b"])
    (tmp_path / "data" / "eval.jsonl").unlink()
    assert predictor_overlap(predictor, _requests("a"))["checked"] is False


def test_intra_runs_every_pair_by_default_and_a_chosen_subset_in_order():
    from bench.decode_experiments import DecodeExperimentOptions, intra_runs

    assert len(intra_runs(DecodeExperimentOptions())) == 3  # no predictor: true lengths only
    assert len(intra_runs(DecodeExperimentOptions(predictor="p"))) == 6
    chosen = DecodeExperimentOptions(
        predictor="p", runs="predicted:reserve-dynamic,true:greedy,true:reserve-dynamic")
    assert intra_runs(chosen) == [("true", "greedy"), ("true", "reserve-dynamic"),
                                  ("predicted", "reserve-dynamic")]
    with pytest.raises(ConfigError, match="predicted:greedy"):
        intra_runs(DecodeExperimentOptions(runs="true:greedy,predicted:greedy"))
