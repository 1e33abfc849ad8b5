"""The disaggregated cluster end to end, through real processes, sockets and HTTP clients."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest
from cluster_fixture import ROOT, Cluster

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):", "1, 2, 3, 4,", "Les feux de la Saint-Jean"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster("--dtype", "float32", log_dir=tmp_path_factory.mktemp("cluster"))
    yield c
    c.stop()


def complete(url, prompt, **extra):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def stream_text(url, prompt, **extra):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
            else:
                assert line in ("", "data: [DONE]"), f"unexpected SSE line {line!r}"
    return chunks


def test_greedy_http_equals_generate_and_stream_equals_non_stream(cluster):
    result = subprocess.run([sys.executable, "-m", "control_plane.cli", "generate", "--dtype",
                             "float32", "--max-tokens", "24", "--json",
                             *sum((["--prompt", p] for p in PROMPTS), [])],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    offline = [json.loads(line) for line in result.stdout.splitlines()]
    for prompt, expected in zip(PROMPTS, offline):
        body = complete(cluster.url, prompt).json()
        assert body["choices"][0]["text"] == expected["text"]
        assert body["usage"]["completion_tokens"] == len(expected["token_ids"])
        assert body["usage"]["prompt_tokens"] == len(expected["prompt_token_ids"])
        chunks = stream_text(cluster.url, prompt)
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert streamed == expected["text"]
        assert chunks[0]["choices"][0]["text"], "the first chunk carries the first token"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]


def test_official_openai_client(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=30,
        temperature=0)
    assert "4" in chat.choices[0].message.content and chat.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=30,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5)
    assert completion.usage.completion_tokens <= 5
    assert [m.id for m in client.models.list()] == [MODEL]


async def _stream_one(client, url, index):
    body = {"model": MODEL, "prompt": f"Story number {index}: once upon a time",
            "max_tokens": 20, "temperature": 0.8, "seed": index, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    text, usage = "", None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage", usage)
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
    return text, usage


def test_32_concurrent_streams_complete_with_correct_usage(cluster):
    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(_stream_one(client, cluster.url, i)
                                          for i in range(32)))

    results = asyncio.run(run())
    from pathlib import Path

    from common.model_files import resolve_model
    from common.tokenizer import TextTokenizer
    tokenizer = TextTokenizer(resolve_model(None, Path("~/.cache/splitserve").expanduser()).hf_dir)
    for index, (text, usage) in enumerate(results):
        assert usage["completion_tokens"] == 20, usage
        assert usage["prompt_tokens"] == len(tokenizer.encode(
            f"Story number {index}: once upon a time"))
        assert text
    assert len({t for t, _ in results}) > 1, "seeded sampling differs across seeds"


def _blocks_in_use(cluster) -> int:
    return sum(i["kv_blocks"]["used"] + i["queue"]["running"] for i in
               cluster.cluster()["instances"])


def test_disconnect_mid_stream_frees_blocks_everywhere(cluster):
    body = {"model": MODEL, "prompt": "Write a very long story about dragons.",
            "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        received = 0
        for line in lines:
            received += line.startswith("data: {")
            if received >= 10:
                break
        assert _blocks_in_use(cluster) > 0
    closed = time.monotonic()
    elapsed = None
    while time.monotonic() - closed < 10:
        if _blocks_in_use(cluster) == 0:
            elapsed = time.monotonic() - closed
            break
        time.sleep(0.05)
    assert elapsed is not None, f"blocks still held: {cluster.cluster()}"
    print(f"blocks back in both pools {elapsed * 1000:.0f} ms after the client left")
    assert elapsed < 1.0


@pytest.mark.parametrize("body,fragment", [
    ("{not json", "JSON"),
    (json.dumps({"prompt": "hi"}), "model"),
    (json.dumps({"model": MODEL}), "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "many"}), "max_tokens"),
    (json.dumps({"model": "gpt-4", "prompt": "hi"}), "does not exist"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}), "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 9000}), "context length"),
    (json.dumps({"model": MODEL, "prompt": "word " * 9000}), "context length"),
    (json.dumps({"model": MODEL, "prompt": "hi", "n": 99}), "n"),
    (json.dumps({"model": MODEL, "prompt": "hi", "frobnicate": 1}), "`frobnicate` is not"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_completion_tokens": 3}),
     "`max_completion_tokens` is not"),
    (json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}), "temperature"),
    (json.dumps({"model": MODEL, "prompt": []}), "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}),
     "stream_options"),
])
def test_bad_input_gets_400_with_openai_error(cluster, body, fragment):
    response = httpx.post(cluster.url + "/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_chat_bad_input(cluster):
    response = httpx.post(cluster.url + "/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    assert response.status_code == 400 and "messages" in response.json()["error"]["message"]
    response = httpx.post(cluster.url + "/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": []})
    assert response.status_code == 400


def test_compatibility_fields_accepted(cluster):
    response = complete(cluster.url, "Hello", max_tokens=3, best_of=1, logprobs=None,
                        stop=None, user="bench", repetition_penalty=1.0)
    assert response.status_code == 200, response.text
    chat = httpx.post(cluster.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
        "max_completion_tokens": 3, "logprobs": None, "stop": None}).json()
    assert chat["usage"]["completion_tokens"] <= 3


def test_stop_string_cuts_output(cluster):
    full = complete(cluster.url, "1, 2, 3, 4,").json()["choices"][0]["text"]
    assert "7" in full
    cut = complete(cluster.url, "1, 2, 3, 4,", stop=["7"]).json()["choices"][0]
    assert cut["text"] == full[:full.index("7")] and cut["finish_reason"] == "stop"


def test_bench_reports_latency_metrics(cluster, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "control_plane.cli", "bench", "--url",
                             cluster.url, "--num-requests", "12", "--rate", "4",
                             "--max-tokens", "32", "--out", str(out)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())["summary"]
    assert summary["num_ok"] == 12 and summary["num_errors"] == 0
    for metric in ("ttft_s", "tpot_s", "jct_s"):
        assert 0 < summary[metric]["p50"] <= summary[metric]["p99"]
    assert summary["throughput"]["output_tokens_per_s"] > 0
