"""Admission control at the gateway: API keys, body and token limits, 429 when full."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from cluster_fixture import Cluster

KEY = "test-key-7f3a"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_models):
    c = Cluster("--model", str(tiny_models["llama"]), "--kv-memory-gib", "0.1",
                "--api-key", KEY, "--max-body-bytes", "4000", "--max-prompt-tokens", "300",
                "--max-output-tokens", "64", "--max-streams-per-client", "2",
                "--retry-after", "2", log_dir=tmp_path_factory.mktemp("admission"))
    c.auth = {"Authorization": f"Bearer {KEY}"}
    yield c
    c.stop()


def _model(cluster) -> str:
    return httpx.get(cluster.url + "/v1/models", headers=cluster.auth).json()["data"][0]["id"]


def test_api_keys(cluster):
    body = {"model": _model(cluster), "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.post(cluster.url + "/v1/completions", json=body, headers=headers)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(cluster.url + "/v1/models").status_code == 401
    assert httpx.get(cluster.url + "/cluster").status_code == 401
    assert httpx.post(cluster.url + "/v1/completions", json=body,
                      headers=cluster.auth).status_code == 200
    assert httpx.get(cluster.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(cluster.url + "/live").status_code == 200


def test_body_and_token_limits(cluster):
    model = _model(cluster)
    big = httpx.post(cluster.url + "/v1/completions", headers=cluster.auth,
                     json={"model": model, "prompt": "x" * 5000})
    assert big.status_code == 413 and "request body" in big.json()["error"]["message"]
    long_prompt = httpx.post(cluster.url + "/v1/completions", headers=cluster.auth,
                             json={"model": model, "prompt": "word " * 350, "max_tokens": 4})
    assert long_prompt.status_code == 400 and "at most 300" in long_prompt.json()["error"]["message"]
    many = httpx.post(cluster.url + "/v1/completions", headers=cluster.auth,
                      json={"model": model, "prompt": "hi", "max_tokens": 100})
    assert many.status_code == 400 and "at most 64" in many.json()["error"]["message"]


def test_concurrent_streams_per_client_get_429_with_retry_after(cluster):
    model = _model(cluster)
    body = {"model": model, "prompt": "Tell a story", "max_tokens": 60, "ignore_eos": True,
            "stream": True}

    async def stream(client):
        async with client.stream("POST", cluster.url + "/v1/completions", json=body,
                                 headers=cluster.auth) as response:
            await response.aread()
            return response.status_code, response.headers.get("retry-after")

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(stream(client) for _ in range(5)))

    results = asyncio.run(run())
    codes = sorted(code for code, _ in results)
    assert codes.count(200) >= 2 and 429 in codes, codes
    assert all(retry == "2" for code, retry in results if code == 429)
    # The slots are released when streams end: a new request goes through.
    after = httpx.post(cluster.url + "/v1/completions", headers=cluster.auth,
                       json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert after.status_code == 200
