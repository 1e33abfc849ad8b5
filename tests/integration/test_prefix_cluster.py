"""Prefix caching across a real cluster (tiny random Llama, float32, greedy): a later turn
reads only the KV blocks its decode instance does not hold; conditional disaggregation prefills
a mostly cached prompt on the decode instance; a flip keeps an instance's cache; and every
answer equals the uncached one, token for token."""

from __future__ import annotations

import time

import httpx
import pytest
from cluster_fixture import Cluster

PROMPT = list(range(300, 500))  # 200 token ids: 12 full blocks of 16 before the last token


@pytest.fixture
def tiny(tiny_models):
    return str(tiny_models["llama"])


def complete(cluster: Cluster, prompt: list[int], max_tokens: int = 16) -> list[int]:
    model = httpx.get(cluster.url + "/v1/models", timeout=5).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    response = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def wait_for(read, ready, timeout: float = 15.0):
    """`read()` once `ready` holds for it (instances report every 100 ms), else the last read."""
    deadline = time.monotonic() + timeout
    value = read()
    while not ready(value) and time.monotonic() < deadline:
        time.sleep(0.05)
        value = read()
    return value


def prefix_stats(cluster: Cluster, role: str, ready=lambda stats: True) -> dict:
    """The prefix-cache counters of the (first) instance of `role`, once `ready` holds."""
    def read():
        instances = [i for i in cluster.cluster()["instances"] if i["role"] == role]
        return sorted(instances, key=lambda i: i["instance_id"])[0]["prefix_cache"]
    return wait_for(read, ready)


def indexed(cluster: Cluster, instance_id: str, num_blocks: int) -> int:
    """Blocks of `instance_id` in the gateway's prefix index, once it knows `num_blocks`."""
    return wait_for(lambda: cluster.cluster()["gateway"]["prefix_index"].get(instance_id, 0),
                    lambda known: known >= num_blocks)


def _flip(cluster: Cluster, instance_id: str, role: str) -> None:
    response = httpx.post(cluster.url + "/cluster/flip",
                          json={"instance_id": instance_id, "role": role}, timeout=10)
    assert response.status_code == 200, response.text
    flip_id, deadline = response.json()["flip_id"], time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(r["flip_id"] == flip_id for r in cluster.cluster()["flips"] or []):
            return
        time.sleep(0.2)
    raise TimeoutError(f"flip {flip_id} did not complete")


def test_a_later_turn_reads_only_missing_blocks(tmp_path, tiny):
    cluster = Cluster("--model", tiny, "--dtype", "float32", "--kv-memory-gib", "0.1",
                      "--local-prefill", "off", log_dir=tmp_path)
    try:
        first = complete(cluster, PROMPT)
        before = prefix_stats(cluster, "decode", lambda s: s["blocks_read"] >= 13)
        assert before["blocks_skipped"] == 0 and before["blocks_read"] == 13
        assert complete(cluster, PROMPT) == first  # the same prompt again: cached both sides
        prefill = prefix_stats(cluster, "prefill", lambda s: s["hit_tokens"] >= 192)
        decode = prefix_stats(cluster, "decode", lambda s: s["blocks_read"] >= 14)
        assert prefill["hit_tokens"] == 192  # 12 blocks; the last token is recomputed
        assert decode["blocks_skipped"] == 12 and decode["blocks_read"] == 13 + 1
        assert decode["local_prefills"] == 0
    finally:
        cluster.stop()


def test_conditional_disaggregation_prefills_a_cached_prompt_on_the_decode_instance(
        tmp_path, tiny):
    cluster = Cluster("--model", tiny, "--dtype", "float32", "--kv-memory-gib", "0.1",
                      "--local-prefill", "on", "--local-prefill-tokens", "32", log_dir=tmp_path)
    try:
        first = complete(cluster, PROMPT)  # 200 uncached tokens: remote prefill, transfer
        received = prefix_stats(cluster, "decode", lambda s: s["blocks_read"] >= 13)
        assert received["local_prefills"] == 0
        assert indexed(cluster, "decode-0", 13) >= 13  # its cache events reached the gateway
        assert complete(cluster, PROMPT) == first
        # one load report can fall between the local prefill's admission (counted) and its
        # forward (the cache hit): wait for both
        decode = prefix_stats(cluster, "decode",
                              lambda s: s["local_prefills"] >= 1 and s["hit_tokens"] >= 192)
        assert decode["local_prefills"] == 1 and decode["hit_tokens"] >= 192
        short = complete(cluster, PROMPT[:20], max_tokens=4)  # short: no cache needed
        assert prefix_stats(cluster, "decode", lambda s: s["local_prefills"] >= 2)[
            "local_prefills"] == 2 and len(short) > 0
    finally:
        cluster.stop()


def test_a_flip_keeps_the_cache(tmp_path, tiny):
    cluster = Cluster("--model", tiny, "--dtype", "float32", "--kv-memory-gib", "0.1",
                      "--prefill", "2", "--decode", "1", "--local-prefill", "off",
                      log_dir=tmp_path)
    try:
        first = complete(cluster, PROMPT)
        views = wait_for(cluster.cluster, lambda view: any(
            i["role"] == "prefill" and i["kv_blocks"]["cached"] > 0 for i in view["instances"]))
        held = [i["instance_id"] for i in views["instances"]
                if i["role"] == "prefill" and i["kv_blocks"]["cached"] > 0]
        assert len(held) == 1
        for role in ("decode", "prefill"):  # there and back
            _flip(cluster, held[0], role)
        assert cluster.instance(held[0])["kv_blocks"]["cached"] >= 12
        assert indexed(cluster, held[0], 12) >= 12  # the gateway still routes by its cache
        assert complete(cluster, PROMPT) == first  # routed to the cache, hits it
        hits = wait_for(lambda: cluster.instance(held[0])["prefix_cache"]["hit_tokens"],
                        lambda tokens: tokens >= 192)
        assert hits == 192
    finally:
        cluster.stop()
