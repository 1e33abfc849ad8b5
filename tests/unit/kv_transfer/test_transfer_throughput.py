"""The transfer benchmark: a tiny run measures every backend it can, says why it skips the others,
writes its JSON and PNG, and its byte check catches a wrong copy."""

from __future__ import annotations

import json

import pytest
import torch

from bench.transfer_throughput import (
    ThroughputOptions,
    check_blocks,
    fill_pattern,
    main,
    run_transfer_throughput,
)
from common.engine.kv_cache import KVCache, KVLayout

SIZES = (64 << 10, 256 << 10)


def test_tiny_run_writes_one_row_per_backend_and_size(tmp_path):
    options = ThroughputOptions(sizes=SIZES, backends=("shm", "tcp", "ucx", "cuda_ipc"),
                                patterns=("contiguous", "scattered"), repeats=2,
                                out=str(tmp_path / "throughput.json"))
    report = run_transfer_throughput(options)

    assert json.loads((tmp_path / "throughput.json").read_text()) == json.loads(
        json.dumps(report))
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert report["failed"] == {}
    measured = {row["backend"] for row in report["rows"]}
    assert {"shm", "tcp"} <= measured
    assert measured | set(report["unavailable"]) == set(options.backends)
    for backend in measured:
        keys = sorted((r["pattern"], r["size"]) for r in report["rows"] if r["backend"] == backend)
        assert keys == sorted((p, s) for p in options.patterns for s in SIZES)
    for row in report["rows"]:
        assert row["bytes"] == row["size"]  # 64 KB blocks: every size is whole blocks
        assert row["gbps"] > 0 and row["ratio"] == pytest.approx(row["gbps"] / row["ceiling_gbps"])
    if not torch.cuda.is_available():
        assert "needs CUDA" in report["unavailable"]["cuda_ipc"]
    if "ucx" in report["unavailable"]:
        assert report["unavailable"]["ucx"].startswith("the ucx backend needs ucx-py")


def test_cli_prints_the_table(tmp_path, capsys):
    out = tmp_path / "cli.json"
    main(["--sizes", str(64 << 10), "--backends", "shm", "--patterns", "contiguous",
          "--repeats", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| shm | contiguous | 64 KB |" in printed
    assert len(json.loads(out.read_text())["rows"]) == 1


def test_block_check_catches_a_wrong_copy():
    layout = KVLayout(2, 8, 4, 1, 8, "bfloat16")
    cache = KVCache(layout)
    fill_pattern(cache.tensor)
    check_blocks(cache.tensor, layout, [3, 5], [3, 5])  # each block holds its own pattern
    with pytest.raises(AssertionError):
        check_blocks(cache.tensor, layout, [3, 5], [4, 5])  # block 4 is not block 3
