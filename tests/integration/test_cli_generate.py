"""`splitserve generate` end to end: JSON output, and one clear line for every bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_cli


def test_generate_json_in_input_order_equals_engine(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "The capital of France is"}) + "\n"
                       + json.dumps({"prompt": "Hello"}) + "\n")
    result = run_cli("generate", "--prompt", "1, 2, 3,", "--prompts-file", str(prompts),
                     "--max-tokens", "8", "--json", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["1, 2, 3,", "The capital of France is", "Hello"]
    assert all(len(r["token_ids"]) <= 8 and r["text"] for r in records)
    assert records[1]["text"].startswith(" Paris")


def test_chat_flag_applies_template():
    result = run_cli("generate", "--prompt", "What is 2+2?", "--chat", "--max-tokens", "20",
                     "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["prompt_token_ids"][:2] == [1, 9690]  # <|im_start|>system
    assert "4" in record["text"]


def test_missing_model(tmp_path):
    assert_one_line_error(run_cli("generate", "--prompt", "x", "--model",
                                  str(tmp_path / "nope")), "does not exist")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    assert_one_line_error(run_cli("generate", "--prompt", "x", "--model", str(bad),
                                  "--cache-dir", str(tmp_path / "cache")), "GGUF")


def test_corrupt_safetensors(tmp_path, tiny_models):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["llama"], bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert_one_line_error(run_cli("generate", "--prompt", "x", "--model", str(bad)),
                          "cannot read weights")


def test_unsupported_architecture(tmp_path, tiny_models):
    odd = tmp_path / "odd"
    shutil.copytree(tiny_models["llama"], odd)
    config = json.loads((odd / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (odd / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run_cli("generate", "--prompt", "x", "--model", str(odd)),
                          "unsupported architecture")


def test_prompt_longer_than_context(tiny_models):
    result = run_cli("generate", "--prompt", "word " * 600, "--model", str(tiny_models["llama"]),
                     "--max-tokens", "4")
    assert_one_line_error(result, "maximum context length is 512")


def test_no_prompts():
    assert_one_line_error(run_cli("generate"), "no prompts")


@pytest.mark.parametrize("flag,value,error", [("--max-tokens", "0", "max_tokens must be"),
                                              ("--top-p", "0", "top_p must be in (0, 1]")])
def test_bad_sampling_values(flag, value, error, tmp_path):
    # refused before any model loads: this model directory does not exist
    assert_one_line_error(run_cli("generate", "--prompt", "x", flag, value, "--model",
                                  str(tmp_path / "none")), error)
