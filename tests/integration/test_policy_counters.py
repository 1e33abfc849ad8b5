"""A co-located cluster reports what its scheduling policy did (`GET /cluster` -> `policy`):
FastServe's entry queues count every request, and the counters only grow."""

from __future__ import annotations

import time

import httpx
from cluster_fixture import Cluster


def _policy(cluster: Cluster) -> dict:
    return [i for i in cluster.cluster()["instances"] if i["role"] == "coupled"][0]["policy"]


def test_fastserve_counters_reach_the_cluster_view(tmp_path, tiny_models):
    cluster = Cluster("--model", str(tiny_models["llama"]), "--dtype", "float32",
                      "--prefill", "0", "--decode", "0", "--coupled", "1",
                      "--policy", "fastserve", "--kv-memory-gib", "0.1", log_dir=tmp_path)
    try:
        model = httpx.get(cluster.url + "/v1/models", timeout=5).json()["data"][0]["id"]
        before = _policy(cluster)
        for length in (8, 64, 400):  # prompts of different first-iteration times
            body = {"model": model, "prompt": list(range(300, 300 + length)), "max_tokens": 24,
                    "temperature": 0, "ignore_eos": True}
            response = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
        after = before
        for _ in range(50):  # a report every 100 ms
            after = _policy(cluster)
            if sum(v for k, v in after.items() if k.startswith("entered_q")) >= 3:
                break
            time.sleep(0.1)
    finally:
        cluster.stop()
    entered = {k: after[k] - before.get(k, 0) for k in after if k.startswith("entered_q")}
    assert sum(entered.values()) == 3, after
    assert len(entered) == 8  # FastServe's default 8 queues, each named
    assert {"preemptions", "recomputes", "swap_outs", "swap_ins", "promotions", "demotions",
            "proactive_swap_outs", "proactive_swap_ins"} <= set(after)
    assert all(after[k] >= before.get(k, 0) for k in after)
    assert after["demotions"] >= 1  # 24 decode iterations use up Q1's quantum at least once
