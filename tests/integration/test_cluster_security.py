"""Internal sockets with a cluster secret: members work together, outsiders are shut out."""

from __future__ import annotations

import time

import httpx
import zmq
from cluster_fixture import Cluster

from common.protocol import GenerateRequest, encode
from common.sampling_params import SamplingParams


def test_only_cluster_members_reach_internal_sockets(tmp_path, tiny_models):
    secret = tmp_path / "secret"
    secret.write_text("correct horse battery staple 42")
    cluster = Cluster("--model", str(tiny_models["llama"]), "--kv-memory-gib", "0.05",
                      "--cluster-secret-file", str(secret), log_dir=tmp_path)
    try:
        model = httpx.get(cluster.url + "/v1/models").json()["data"][0]["id"]
        ok = httpx.post(cluster.url + "/v1/completions", timeout=60,
                        json={"model": model, "prompt": "hello", "max_tokens": 8})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
        prefill = next(i for i in cluster.cluster()["instances"] if i["role"] == "prefill")
        ctx = zmq.Context()
        rogue = ctx.socket(zmq.PUSH)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(prefill["inbox"])
        rogue.send(encode(GenerateRequest("rogue", [1, 2, 3], SamplingParams(max_tokens=500,
                                                                           ignore_eos=True),
                                          "tcp://127.0.0.1:9", time.time())), zmq.NOBLOCK)
        reader = ctx.socket(zmq.DEALER)
        reader.setsockopt(zmq.LINGER, 0)
        reader.connect(prefill["kv_endpoint"])
        reader.send(b"\x92\x01\x91\x00")  # a read request for block 0
        assert not reader.poll(1500), "an outsider must not get KV data"
        time.sleep(0.5)
        for state in cluster.cluster()["instances"]:  # the rogue request ran nowhere
            assert state["queue"]["waiting"] == state["queue"]["running"] == 0, state
            assert state["kv_blocks"]["used"] == 0, state
        ctx.destroy(0)
    finally:
        cluster.stop()
