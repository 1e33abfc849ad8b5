"""scripts/gpu_check.py, the parts that run without a GPU: its flags, the one-line error and exit
status 2 on a host without CUDA, where it finds tokenizer files, and the summary ratios it
computes from the steps' results. The measurements themselves need a GPU (not run here)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults_run_every_step(gpu_check):
    args = gpu_check.parse_args(["--out", "r.json"])
    assert args.steps == gpu_check.STEPS == ("tests", "parity", "engine", "hf", "served")
    assert (args.out, args.streams, args.dtype, args.quick) == ("r.json", 64, "bfloat16", False)
    assert args.tokenizer_dir is None and args.work is None


def test_steps_subset_and_bad_flags(gpu_check, capsys):
    args = gpu_check.parse_args(["--out", "r.json", "--steps", "engine, hf", "--quick",
                                 "--tokenizer-dir", "/t", "--streams", "8"])
    assert args.steps == ("engine", "hf") and args.quick
    assert args.tokenizer_dir == "/t" and args.streams == 8
    for bad in (["--out", "r.json", "--steps", "engine,bogus"], ["--out", "r.json", "--steps", ","],
                ["--steps", "engine"], ["--out", "r.json", "--dtype", "float32"]):
        with pytest.raises(SystemExit) as exit_info:
            gpu_check.parse_args(bad)
        assert exit_info.value.code == 2
    assert "bogus" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_without_cuda_one_error_line_and_status_2(tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no CUDA device" in lines[0], done.stderr
    assert not out.exists()


def test_tokenizer_from_flag_or_from_a_converted_model(gpu_check, tmp_path):
    assert gpu_check.tokenizer_dir(gpu_check.parse_args(
        ["--out", "r", "--tokenizer-dir", str(tmp_path)])) == tmp_path
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "tokenizer.json").write_text("{}")
    args = gpu_check.parse_args(["--out", "r", "--cache-dir", str(tmp_path)])
    assert gpu_check.tokenizer_dir(args) == model


def test_summary_ratios(gpu_check):
    data = {"weight_read_ms": 0.5,
            "engine": {"decode_graphs_on": [
                {"batch": 1, "step_ms": 2.0, "tokens_per_s": 500.0},
                {"batch": 32, "step_ms": 4.0, "tokens_per_s": 8000.0},
                {"batch": 64, "step_ms": 6.4, "tokens_per_s": 10000.0}]},
            "hf": [{"batch": 1, "step_ms": 12.0}, {"batch": 32, "step_ms": 20.0},
                   {"batch": 128, "step_ms": 25.0}],
            "served_co-located": {"layout": "co-located", "streams": 64,
                                  "throughput": {"output_tokens_per_s": 2500.0}}}
    assert gpu_check.summary(data) == {
        "decode_batch1_over_weight_read": 4.0, "decode_batch1_speedup_vs_generate": 6.0,
        "decode_batch32_speedup_vs_generate": 5.0, "served_co-located_over_engine": 0.25}
    assert gpu_check.summary({"errors": {}}) == {}
