"""Several sequences per request against a real cluster: `n` (seeded choices reproducible across
runs and batches, the prompt's blocks shared through the prefix cache), `best_of` ranked by
cumulative log-probability, lists of prompts, and their streams."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from cluster_fixture import Cluster

MODEL = "SmolLM2-135M-Instruct"
LONG = "The history of the old harbour town is long and complicated. " * 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # local prefill off: every sequence takes the prefill instance -> decode instance path
    c = Cluster("--dtype", "float32", "--local-prefill", "off",
                log_dir=tmp_path_factory.mktemp("choices"))
    yield c
    c.stop()


def complete(url, **body):
    response = httpx.post(url + "/v1/completions", timeout=120,
                          json={"model": MODEL, "max_tokens": 10, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream(url, **body):
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
            "model": MODEL, "max_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True}, **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _texts(body) -> list[str]:
    return [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]


def _prefill_hits(cluster) -> int:
    return sum(i["prefix_cache"]["hit_tokens"] for i in cluster.cluster()["instances"]
               if i["role"] == "prefill")


def test_seeded_n_gives_the_same_choices_every_run_and_batch(cluster):
    body = {"prompt": LONG, "n": 4, "seed": 11, "temperature": 0.8, "top_p": 0.95}
    first = complete(cluster.url, **body)
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    assert first["usage"]["completion_tokens"] == 40
    assert len(set(_texts(first))) > 1  # different seeds per choice

    async def in_a_crowd():  # the same request again, batched with unrelated traffic
        async with httpx.AsyncClient(timeout=120) as client:
            noise = [client.post(cluster.url + "/v1/completions", json={
                "model": MODEL, "prompt": f"Noise {i} " * 5, "max_tokens": 20,
                "temperature": 1.0}) for i in range(6)]
            results = await asyncio.gather(client.post(
                cluster.url + "/v1/completions", json={"model": MODEL, "max_tokens": 10,
                                                       **body}), *noise)
        return results[0].json()

    assert _texts(asyncio.run(in_a_crowd())) == _texts(first)
    assert _texts(complete(cluster.url, **body)) == _texts(first)


def test_choices_share_the_prompt_blocks(cluster):
    before = _prefill_hits(cluster)
    prompt = LONG + " A new tail so the prefix is not cached yet."
    body = complete(cluster.url, prompt=prompt, n=3, temperature=0.7, seed=1)
    full_blocks = body["usage"]["prompt_tokens"] // 16 * 16
    hits = _prefill_hits(cluster) - before
    # the two later choices each found the prompt's full blocks cached (the last token of a
    # prompt is always computed: a prompt ending on a block boundary shares one block less)
    assert hits >= 2 * (full_blocks - 16), (hits, full_blocks)


def test_a_list_of_prompts_gives_choices_in_prompt_order(cluster):
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    body = complete(cluster.url, prompt=prompts, n=2, temperature=0)
    singles = [_texts(complete(cluster.url, prompt=p, temperature=0))[0] for p in prompts]
    assert _texts(body) == [singles[0], singles[0], singles[1], singles[1]]
    assert body["usage"]["completion_tokens"] == 40


def test_token_prompts_in_a_list(cluster):
    body = complete(cluster.url, prompt=[[19556, 28], [504, 3575]], temperature=0)
    alone = complete(cluster.url, prompt=[504, 3575], temperature=0)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][1]["text"] == alone["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == 4


def test_best_of_returns_the_likeliest_candidates(cluster):
    body = complete(cluster.url, prompt=LONG, n=2, best_of=4, temperature=1.0, seed=3,
                    logprobs=0)
    assert len(body["choices"]) == 2
    assert all(len(c["logprobs"]["token_logprobs"]) == 10 for c in body["choices"])
    totals = [sum(c["logprobs"]["token_logprobs"]) for c in body["choices"]]
    assert totals[0] >= totals[1]
    every = complete(cluster.url, prompt=LONG, n=4, temperature=1.0, seed=3, logprobs=0)
    every_totals = sorted((sum(c["logprobs"]["token_logprobs"]) for c in every["choices"]),
                          reverse=True)
    # the same four seeded candidates; best_of kept the two likeliest
    assert totals == pytest.approx(every_totals[:2], abs=1e-4)
    plain = complete(cluster.url, prompt=LONG, n=1, best_of=2, temperature=1.0)
    assert plain["choices"][0]["logprobs"] is None  # ranked, not shown unless asked


def test_streamed_choices_equal_the_whole_response(cluster):
    body = {"prompt": LONG, "n": 3, "seed": 5, "temperature": 0.8}
    chunks = stream(cluster.url, **body)
    texts: dict[int, str] = {}
    finishes = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert [texts[i] for i in range(3)] == _texts(complete(cluster.url, **body))
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 30


def test_nothing_is_held_after_choices_finish(cluster):
    complete(cluster.url, prompt=LONG, n=5, temperature=1.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # instances report every interval: wait for it
        held = [(i["queue"]["running"] + i["queue"]["waiting"], i["kv_blocks"]["used"])
                for i in cluster.cluster()["instances"]]
        if all(h == (0, 0) for h in held):
            break
        time.sleep(0.1)
    assert all(h == (0, 0) for h in held), held
