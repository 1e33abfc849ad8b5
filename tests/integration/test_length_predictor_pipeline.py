"""The length-predictor pipeline end to end on a small ShareGPT slice and a tiny random model:
build-dataset (engine labels) -> train probe and classifier -> eval -> overhead; and the probe
learning from real prefill hidden states of our ModelRunner."""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import httpx
import pytest
import torch
from cluster_fixture import Cluster, run_load
from prometheus_client.parser import text_string_to_metric_families

from common.config import EngineConfig, ModelConfig
from common.engine.llm_engine import LLMEngine
from length_predictor import cli
from length_predictor.base import load_predictor
from length_predictor.dataset import load_dataset
from length_predictor.label_journal import JOURNAL_FILE
from length_predictor.features import ExtractOptions, FeatureExtractor
from length_predictor.probe import ProbeOptions, train_head


def _run(add, run, argv: list) -> int:
    parser = argparse.ArgumentParser()
    add(parser)
    return run(parser.parse_args([str(a) for a in argv]))


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory, tiny_models):
    out = tmp_path_factory.mktemp("lp") / "data"
    assert _run(cli.add_build_dataset_args, cli.run_build_dataset, [
        "--out", out, "--labels", "engine", "--limit", 14, "--max-output-tokens", 16,
        "--model", tiny_models["llama"], "--threads", 1, "--kv-memory-gib", 0.1]) == 0
    return out


def test_engine_labels_are_the_greedy_output_lengths(dataset_dir, tiny_models):
    dataset = load_dataset(dataset_dir)
    examples = dataset.train + dataset.eval
    assert dataset.metadata["labels"] == "engine" and dataset.metadata["num_pairs"] == 14
    assert len(examples) == 14 - dataset.metadata["num_skipped_too_long"] >= 8
    assert all(0 <= e.num_output_tokens <= 16 for e in examples)
    engine = LLMEngine(EngineConfig(model=ModelConfig(path=str(tiny_models["llama"]))))
    try:
        params = engine.default_params(max_tokens=16, temperature=0.0)
        (result,) = engine.generate([examples[0].prompt_token_ids], [params])
    finally:
        engine.close()
    eos = set(engine.tokenizer.eos_token_ids)
    expected = len(result.token_ids) - int(result.token_ids[-1] in eos)
    assert examples[0].num_output_tokens == expected


def test_a_rerun_resumes_from_the_label_journal(dataset_dir, tiny_models, tmp_path, capsys):
    first = load_dataset(dataset_dir)
    out = tmp_path / "more"
    out.mkdir()
    (out / JOURNAL_FILE).write_bytes((dataset_dir / JOURNAL_FILE).read_bytes())
    capsys.readouterr()
    assert _run(cli.add_build_dataset_args, cli.run_build_dataset, [
        "--out", out, "--labels", "engine", "--limit", 16, "--max-output-tokens", 16,
        "--model", tiny_models["llama"], "--threads", 1, "--kv-memory-gib", 0.1]) == 0
    labelled = len(first.train) + len(first.eval)
    assert f"{labelled} labels already in" in capsys.readouterr().err
    second = load_dataset(out)
    before = {e.example_id: e.num_output_tokens for e in first.train + first.eval}
    after = {e.example_id: e.num_output_tokens for e in second.train + second.eval}
    assert before.items() <= after.items() and len(after) > len(before)


def test_train_eval_and_overhead_on_the_slice(dataset_dir, tiny_models, tmp_path):
    probe, clf = tmp_path / "probe", tmp_path / "clf"
    assert _run(cli.add_train_args, cli.run_train, [
        "--kind", "probe", "--dataset", dataset_dir, "--out", probe, "--granularity", "4,8",
        "--probe-epochs", 5]) == 0
    assert _run(cli.add_train_args, cli.run_train, [
        "--kind", "classifier", "--dataset", dataset_dir, "--out", clf, "--granularity", 8,
        "--backbone", tiny_models["llama"], "--num-layers", 0, "--max-steps", 3,
        "--batch-size", 4]) == 0
    for directory, g in ((probe / "g4", 4), (probe / "g8", 8), (clf, 8)):
        result = json.loads((directory / "eval" / "results.json").read_text())
        assert result["granularity"] == g and 0.0 <= result["accuracy"] <= 1.0
        assert (directory / "eval" / "confusion.png").stat().st_size > 1000
    assert "| probe | engine |" in (probe / "table.md").read_text()

    out = tmp_path / "eval"
    assert _run(cli.add_eval_args, cli.run_eval, [
        "--predictor", probe, "--predictor", clf, "--dataset", dataset_dir, "--out", out]) == 0
    rescored = json.loads((out / "g8" / "results.json").read_text())
    trained = json.loads((probe / "g8" / "eval" / "results.json").read_text())
    assert rescored["accuracy"] == trained["accuracy"]  # same predictor, same split

    for predictor in (probe / "g8", clf):
        report_path = tmp_path / f"overhead-{predictor.name}.json"
        assert _run(cli.add_overhead_args, cli.run_overhead, [
            "--predictor", predictor, "--num-prompts", 4, "--chunk-size", 64,
            "--max-prompt-tokens", 200, "--repeats", 1, "--out", report_path]) == 0
        report = json.loads(report_path.read_text())
        assert report["with"]["num_predicted"] == 4
        assert report["without"]["throughput_tok_s"] > 0 and report["throughput_ratio"] > 0


def test_probe_learns_from_our_runners_prefill_hidden_states(tiny_models):
    """Labels set by a marker ending the prompt: learnable from the last-token hidden state."""
    rng = random.Random(0)
    markers = (100, 2000, 30000)
    labels = torch.tensor([rng.randrange(3) for _ in range(300)])
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 40))] + [markers[y]]
               for y in labels.tolist()]
    config = EngineConfig(model=ModelConfig(path=str(tiny_models["llama"]), dtype="float32"))
    extractor = FeatureExtractor.from_config(config, ExtractOptions(tokens_per_forward=256))
    try:
        features = extractor.extract(prompts, progress=False)
        again = extractor.extract(prompts[:5], progress=False)  # batching changes nothing
    finally:
        extractor.close()
    torch.testing.assert_close(again, features[:5], atol=1e-4, rtol=1e-4)
    head, _ = train_head(features[:240], labels[:240], 3, ProbeOptions(epochs=80))
    accuracy = (head(features[240:]).argmax(-1) == labels[240:]).float().mean().item()
    assert accuracy > 0.55, accuracy  # chance is 1/3


def _predictions_scored(metrics_url: str) -> int:
    families = text_string_to_metric_families(httpx.get(metrics_url + "/metrics").text)
    return int(sum(sample.value for family in families for sample in family.samples
                   if sample.name == "splitserve_length_predictions_total"))


@pytest.mark.parametrize("kind", ["probe", "classifier"])
def test_served_requests_carry_the_trained_predictors_buckets(dataset_dir, tiny_models, tmp_path,
                                                              kind):
    """A trained predictor beside the prefill instance: every request reaches decode with a
    prediction, which decode scores against the realized length."""
    out = tmp_path / kind
    # The probe reads two layers, so the prefill forward taps an intermediate one too.
    extra = (["--probe-epochs", 5, "--probe-layers", "1,2", "--probe-heads-per-layer", 2]
             if kind == "probe" else
             ["--backbone", tiny_models["llama"], "--num-layers", 0, "--max-steps", 2,
              "--batch-size", 4])
    assert _run(cli.add_train_args, cli.run_train, [
        "--kind", kind, "--dataset", dataset_dir, "--out", out, "--granularity", 8,
        "--no-eval", *extra]) == 0
    if kind == "probe":
        assert load_predictor(out).hidden_layers == (1, 2)
    cluster = Cluster("--model", str(tiny_models["llama"]), "--predictor", str(out),
                      "--heavy-threshold", "8", "--local-prefill", "off",  # all predicted
                      log_dir=tmp_path)
    try:
        model = httpx.get(cluster.url + "/v1/models").json()["data"][0]["id"]
        outcomes = asyncio.run(run_load([cluster.url], 12, model, concurrency=6,
                                        max_tokens=(4, 20)))
        assert all(o["status"] == 200 and not o["error"] for o in outcomes)
        decodes = [i for i in cluster.cluster()["instances"] if i["role"] == "decode"]
        assert sum(_predictions_scored(d["metrics_url"]) for d in decodes) == 12
    finally:
        cluster.stop()
