"""`splitserve profile` on a tiny model: the report's shape, its ratios, and a too-small pool."""

from __future__ import annotations

import json

from helpers import run_cli

SMALL = ["--max-prefill-tokens", "32", "--max-decode-batch", "4", "--decode-context", "32",
         "--repeats", "1", "--dtype", "float32"]


def test_profile_writes_a_report_with_ratios_and_a_chunk_size(tiny_models, tmp_path):
    out = tmp_path / "profile"
    result = run_cli("profile", *SMALL, "--out", str(out), "--model", str(tiny_models["llama"]),
                     "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "profile.json").read_text())
    sizes = [row["tokens"] for row in report["prefill"]]
    assert sizes == [1, 2, 4, 8, 16, 32]
    assert [row["batch"] for row in report["decode"]] == [1, 2, 4]
    # mixed rows within the limits: half the largest prompt beside one decode
    assert [(r["prefill_tokens"], r["batch"]) for r in report["mixed"]] == [(16, 1)]
    assert all(r["seconds"] > 0 for r in report["mixed"])
    # the shapes only the simulator reads, within the limits: batch <= 4, context < 512 (the
    # tiny model's length), at most 32 prompt tokens in all
    assert [(r["batch"], r["context"]) for r in report["decode_contexts"]] == [(1, 64)]
    assert [(r["prompts"], r["tokens"]) for r in report["multi_prompt"]] == [(2, 16)]
    assert all(r["step_seconds"] > 0 for r in report["decode_contexts"])
    assert all(r["seconds"] > 0 for r in report["multi_prompt"])
    assert report["recommended_chunk_size"] in sizes
    assert report["ratios"]["prefill_fraction_of_matmul_rate"] > 0
    assert report["ratios"]["decode_batch1_over_weight_stream"] > 0
    assert "native matmul dtypes" in report["cpu"]
    assert (out / "profile.png").stat().st_size > 0
    # The knee is recorded for the roles that read it (ChunkSize default).
    record = json.loads((tmp_path / "cache" / "profile.json").read_text())
    for key in ("mixed", "decode_contexts", "multi_prompt"):  # the simulator's fit reads them
        assert record[key] == report[key]


def test_profile_with_a_pool_too_small_for_the_batch_says_so(tiny_models, tmp_path):
    result = run_cli("profile", *SMALL, "--num-blocks", "4", "--out", str(tmp_path / "p"),
                     "--model", str(tiny_models["llama"]), "--cache-dir", str(tmp_path / "c"))
    # Progress lines come first; the error is one line at the end, with no traceback.
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "error: KV pool too small for decode batch 2" in result.stderr.splitlines()[-1]


def test_forward_breakdown_times_each_part(tiny_models, tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "bench.forward_breakdown", "--model", str(tiny_models["llama"]),
         "--prefill", "8", "--decode", "2", "--context", "16", "--repeats", "2",
         "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    tables = result.stdout.strip().split("\n\n")
    assert "prefill 8 tokens" in tables[0] and "decode batch 2 x 16 tokens" in tables[1]
    for table in tables:
        parts = dict(line.strip("|").split("|") for line in table.splitlines()
                     if line.startswith("| ") and "ms per" not in line)
        times = {k.strip(): float(v) for k, v in parts.items()}
        assert times["execute"] > 0 and 0 < times["linear"] <= times["execute"]
        assert times["attention"] <= times["execute"]
