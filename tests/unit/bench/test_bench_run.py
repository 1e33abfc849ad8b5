"""bench.run: options and flags, the JSON report and the summary table (no server needed)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.client import RequestRecord
from bench.run import BenchOptions, add_bench_args, build_report, format_summary, options_from_args
from bench.workload import BenchRequest
from common.config import ConfigError


def _parse(*argv: str) -> BenchOptions:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return options_from_args(parser.parse_args(list(argv)))


def test_flag_defaults_match_options():
    assert _parse() == BenchOptions()


def test_flags_set_every_option():
    options = _parse("--url", "http://127.0.0.1:9000", "--model", "m", "--tokenizer", "/t",
                     "--num-requests", "7", "--rate", "inf", "--arrival", "gamma", "--cv", "2",
                     "--max-tokens", "32", "--max-prompt-tokens", "512",
                     "--no-reference-lengths", "--ignore-eos", "--temperature", "0.5",
                     "--seed", "3", "--out", "x.json", "--cache-dir", "/c")
    assert options == BenchOptions(
        url="http://127.0.0.1:9000", model="m", tokenizer_path="/t", cache_dir="/c",
        num_requests=7, rate=float("inf"), arrival="gamma", cv=2.0, max_tokens=32,
        max_prompt_tokens=512, use_reference_lengths=False, ignore_eos=True, temperature=0.5,
        seed=3, out="x.json")


@pytest.mark.parametrize("bad", [{"rate": 0.0}, {"num_requests": 0}, {"arrival": "uniform"},
                                 {"cv": -1.0}, {"max_tokens": 0}, {"temperature": -0.1}])
def test_bad_options_are_config_errors(bad):
    with pytest.raises(ConfigError):
        BenchOptions(**bad)


def test_report_is_strict_json_and_table_prints():
    options = BenchOptions(rate=float("inf"))
    requests = [BenchRequest("p", 3, 2, 5), BenchRequest("q", 4, 2, 2)]
    records = [RequestRecord(index=0, send_time=0.0, ttft=0.1, token_times=[0.1, 0.3], jct=0.4,
                             prompt_tokens=3, output_tokens=2, finish_reason="length",
                             http_status=200),
               RequestRecord(index=1, send_time=0.0, jct=0.2, error="HTTP 500: boom",
                             http_status=500)]
    report = build_report(options, "m", requests, [0.0, 0.0], records)
    text = json.dumps(report, allow_nan=False)  # raises on Infinity/NaN
    assert json.loads(text)["options"]["rate"] == "inf"
    assert report["requests"][0]["reference_output_tokens"] == 5
    assert report["requests"][1]["error"] == "HTTP 500: boom"
    assert report["summary"]["num_errors"] == 1
    table = format_summary(report["summary"])
    assert "TTFT" in table and "100.0" in table  # TTFT 0.1 s in ms
    assert "1 ok, 1 errors of 2 requests" in table
    assert "error x1: HTTP 500: boom" in table
