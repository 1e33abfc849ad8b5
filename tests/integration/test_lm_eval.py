"""lm-evaluation-harness against a real cluster: a local multiple-choice task
(tests/data/lm_eval/general_knowledge.*) scored through `local-completions` (our
/v1/completions with token-id prompts, `echo`, `logprobs: 1`, `max_tokens: 1`) must give the
same per-item log-likelihoods, greedy flags and accuracy as the harness's own Hugging Face
backend on the same weights in float32.

Nothing is fetched: the task's data is a local JSONL file, the tokenizer and model are the
default model's converted HF folder in the splitserve cache, and the Hub is switched off.
The task YAML names its data relative to the repository root; the test writes a copy naming it
absolutely (datasets.load_dataset resolves `data_files` against the working directory) and
passes that folder as the harness's include path.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from cluster_fixture import Cluster

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "tests" / "data" / "lm_eval"
TASK = "splitserve_general_knowledge"
SERVED = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-4  # absolute, per continuation log-likelihood (a sum over its tokens)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))


def _task_folder(tmp_path: Path) -> Path:
    """A copy of the task YAML whose data file is named by its absolute path."""
    import yaml

    config = yaml.safe_load((TASK_DIR / "general_knowledge.yaml").read_text())
    relative = config["dataset_kwargs"]["data_files"]["test"]
    config["dataset_kwargs"]["data_files"]["test"] = str(ROOT / relative)
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "general_knowledge.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder


def _evaluate(model: str, model_args: dict, task_folder: Path, batch_size: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_folder), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[TASK], task_manager=manager,
        batch_size=batch_size, device="cpu", log_samples=True, bootstrap_iters=0)
    assert results is not None
    return results


def _per_item(results: dict) -> dict[int, list[tuple[str, float, bool]]]:
    """doc_id -> [(continuation, log-likelihood, is_greedy)] in choice order."""
    out = {}
    for sample in results["samples"][TASK]:
        continuations = [continuation for _, continuation in sample["arguments"]]
        out[sample["doc_id"]] = [(text, float(ll), bool(greedy)) for text, (ll, greedy)
                                 in zip(continuations, sample["filtered_resps"])]
    return out


def _scores(results: dict) -> dict[str, float]:
    metrics = results["results"][TASK]
    return {name: metrics[f"{name},none"] for name in ("acc", "acc_norm")}


def test_local_completions_match_hf_backend(tmp_path, default_model, offline):
    hf_dir = str(default_model.hf_dir)
    folder = _task_folder(tmp_path)
    items = len((ROOT / "tests/data/lm_eval/general_knowledge.jsonl").read_text().splitlines())

    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    cluster = Cluster("--dtype", "float32", log_dir=log_dir)
    try:
        # batch_size 8: each request carries up to 8 token-id prompts, answered as a list of
        # choices the harness orders by `index`.
        served = _evaluate("local-completions", {
            "model": SERVED, "base_url": f"{cluster.url}/v1/completions",
            "tokenizer": hf_dir, "tokenizer_backend": "huggingface",
            "num_concurrent": 1, "max_retries": 1}, folder, batch_size=8)
    finally:
        cluster.stop()  # frees the CPU for the reference run
    reference = _evaluate("hf", {"pretrained": hf_dir, "dtype": "float32"}, folder,
                          batch_size=16)

    ours, theirs = _per_item(served), _per_item(reference)
    assert sorted(ours) == sorted(theirs) == list(range(items))
    worst = 0.0
    for doc_id, expected in theirs.items():
        got = ours[doc_id]
        assert [c for c, _, _ in got] == [c for c, _, _ in expected]
        for (text, ll, greedy), (_, want, want_greedy) in zip(got, expected):
            assert math.isfinite(ll) and ll < 0, (doc_id, text, ll)
            worst = max(worst, abs(ll - want))
            assert ll == pytest.approx(want, abs=TOLERANCE), (doc_id, text, ll, want)
            assert greedy == want_greedy, (doc_id, text, ll, want)
    print(f"largest per-item log-likelihood difference: {worst:.3g}")

    # Accuracy per item (the argmax over choices) and overall.
    for sample_ours, sample_ref in zip(sorted(served["samples"][TASK], key=lambda s: s["doc_id"]),
                                       sorted(reference["samples"][TASK],
                                              key=lambda s: s["doc_id"])):
        assert (sample_ours["acc"], sample_ours["acc_norm"]) == (sample_ref["acc"],
                                                                  sample_ref["acc_norm"])
    assert _scores(served) == _scores(reference)
