"""The gateway's load picture while an instance runs a long forward (control_plane/cluster.py).

Two co-located instances, a long prompt sent to the first, a second prompt while it prefills:
the second must go to the idle instance. Before the echo (`InstanceStats.requests_seen`) the
instance's heartbeat thread resent its last report every 100 ms during the forward and each
repeat cleared the gateway's count of the prompt it had sent there, so the tie sent the second
prompt to queue behind the first (5 of 5 trials on 2026-11-27, against 0 of 5 with the echo).
"""

from __future__ import annotations

import threading
import time

import httpx

from cluster_fixture import Cluster


def _query_tokens(cluster: Cluster) -> dict[str, int]:
    return {i["instance_id"]: i["prefix_cache"]["query_tokens"]
            for i in cluster.cluster()["instances"]}


def _complete(url: str, prompt: str, done: list) -> None:
    response = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    done.append(response.status_code)


def test_a_prompt_sent_during_a_long_prefill_goes_to_the_idle_instance(tmp_path, default_model):
    # The long prompt (about 2,100 tokens, one forward under vllm's policy) must still be in
    # its forward when the second prompt arrives 0.5 s later: a 2,048-token prefill on one
    # thread took 1.4 s on the fastest host seen (a Xeon with AMX, bfloat16) and 18 s on a
    # Zen 1 (float32) in their profiles. (It was 6,400 tokens, 110 s of the suite on the Zen 1,
    # for no more than this.)
    cluster = Cluster("--prefill", "0", "--decode", "0", "--coupled", "2", "--policy", "vllm",
                      "--local-prefill", "off", "--threads-per-instance", "1", log_dir=tmp_path)
    try:
        before = _query_tokens(cluster)
        long_prompt = " ".join(f"alpha{i}" for i in range(560))
        done: list[int] = []
        first = threading.Thread(target=_complete, args=(cluster.url, long_prompt, done))
        first.start()
        time.sleep(0.5)
        _complete(cluster.url, " ".join(f"beta{i}" for i in range(300)), done)
        first.join()
        after = _query_tokens(cluster)
    finally:
        cluster.stop()
    assert done == [200, 200]
    grew = sorted(after[i] - before[i] for i in before)
    assert grew[0] > 0, f"both prompts went to one instance: {before} -> {after}"
