"""Control plane on Redis: several gateways, instance failures, flips, a Redis restart.

These tests run real processes with a tiny random-weight model (fast on 2 cores) and real Redis.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid

import httpx
import pytest
from cluster_fixture import Cluster, GatewayProcess, RedisServer, run_load

REDIS = "redis://127.0.0.1:6379/14"


def _redis_or_skip():
    import redis

    try:
        redis.Redis.from_url(REDIS).ping()
    except redis.ConnectionError:
        pytest.skip("no Redis server on 127.0.0.1:6379 (.ci/run starts one)")


def _served(cluster: Cluster) -> str:
    return httpx.get(cluster.url + "/v1/models", timeout=5).json()["data"][0]["id"]


def _load_in_background(cluster: Cluster, model: str, count: int, **options):
    """`run_load` on a thread, started; join it, then read the outcomes from `results["out"]`."""
    results: dict = {}
    loader = threading.Thread(target=lambda: results.update(out=asyncio.run(run_load(
        [cluster.url], count, model, **options))))
    loader.start()
    return loader, results


def _ids(view: dict) -> dict[str, str]:
    return {i["instance_id"]: i["role"] for i in view["instances"]}


def _held(view: dict) -> list[tuple[str, int, int]]:
    return [(i["instance_id"], i["kv_blocks"]["used"], i["queue"]["running"])
            for i in view["instances"] if i["ready"]]


def _wait_idle(cluster, timeout=20.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = [h for h in _held(cluster.cluster()) if h[1] or h[2]]
        if not held:
            return []
        time.sleep(0.2)
    return held


def _check_outcomes(outcomes: list[dict], allow_errors: bool) -> tuple[int, int]:
    completed = errored = 0
    for o in outcomes:
        assert o["status"] == 200, o
        if o["error"]:
            assert allow_errors, o
            errored += 1
        else:
            assert o["tokens"] == o["want"], o
            completed += 1
    return completed, errored


@pytest.fixture
def tiny(tiny_models):
    return str(tiny_models["llama"])


def test_two_gateways_share_one_cluster(tmp_path, tiny):
    _redis_or_skip()
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    store = ["--redis", REDIS, "--store-prefix", prefix]
    cluster = Cluster("--model", tiny, "--kv-memory-gib", "0.1", *store, log_dir=tmp_path)
    second = None
    try:
        second = GatewayProcess("--model", tiny, *store, log_dir=tmp_path)
        outcomes = asyncio.run(run_load([cluster.url, second.url], 100, _served(cluster)))
        assert _check_outcomes(outcomes, allow_errors=False) == (100, 0)
        assert _ids(cluster.cluster()) == _ids(second.cluster())
        leaders = [cluster.cluster()["gateway"]["leader"], second.cluster()["gateway"]["leader"]]
        assert sorted(leaders) == [False, True]
        assert _wait_idle(cluster) == []
    finally:
        if second:
            second.stop()
        cluster.stop()


@pytest.mark.parametrize("victim_role,layout", [("decode", ("1", "2")), ("prefill", ("2", "1"))])
def test_kill_9_mid_load_loses_no_request_and_leaks_no_block(tmp_path, tiny, victim_role, layout):
    # A prefill victim must get work: short prompts would otherwise be prefilled on the decode
    # instance (conditional disaggregation); a decode victim runs with it on.
    local = ["--local-prefill", "off"] if victim_role == "prefill" else []
    cluster = Cluster("--model", tiny, "--prefill", layout[0], "--decode", layout[1],
                      "--kv-memory-gib", "0.1", "--instance-timeout", "1.0", *local,
                      log_dir=tmp_path)
    try:
        victim = next(i for i in cluster.cluster()["instances"] if i["role"] == victim_role)
        # Killed once it is seen working (a fixed delay let the faster kernels finish the whole
        # load first: nothing was interrupted), and a load long enough for that to happen.
        killed = threading.Event()
        killer = threading.Thread(target=_kill_when_busy, args=(cluster, victim, killed))
        killer.start()
        outcomes = asyncio.run(run_load([cluster.url], 50, _served(cluster), concurrency=25,
                                        max_tokens=(120, 240), stream_every=1))
        killer.join()
        assert killed.is_set(), "the victim was never seen running a sequence"
        completed, errored = _check_outcomes(outcomes, allow_errors=True)
        print(f"kill -9 {victim_role}: {completed} completed, {errored} error events")
        assert completed + errored == 50
        survivors = _ids(cluster.cluster())
        assert victim["instance_id"] not in survivors
        assert _wait_idle(cluster) == [], "blocks held for dead requests"
    finally:
        cluster.stop()


def _kill_when_busy(cluster, victim: dict, killed: threading.Event, timeout: float = 30.0):
    """SIGKILL the victim as soon as it reports work: a sequence running, queued or in transfer,
    or any forward done (a prefill instance runs each short prompt for milliseconds, between
    two of its 100 ms reports; under a long load it still has work to come when killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = next((i for i in cluster.cluster()["instances"]
                     if i["instance_id"] == victim["instance_id"]), None)
        if view is not None and (view["busy_seconds"] > 0 or any(
                view["queue"][k] for k in ("running", "waiting", "transferring"))):
            os.kill(victim["pid"], signal.SIGKILL)
            killed.set()
            return
        time.sleep(0.02)


def _flip(cluster, instance_id, role):
    response = httpx.post(cluster.url + "/cluster/flip", json={"instance_id": instance_id,
                                                               "role": role}, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["flip_id"]


def _wait_flip(cluster, flip_id, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in cluster.cluster()["flips"] or []:
            if record["flip_id"] == flip_id:
                return record
        time.sleep(0.2)
    raise TimeoutError(f"flip {flip_id} did not complete")


def test_flip_under_load_loses_no_request(tmp_path, tiny):
    cluster = Cluster("--model", tiny, "--prefill", "2", "--decode", "1", "--kv-memory-gib",
                      "0.1", log_dir=tmp_path)
    try:
        model = _served(cluster)
        prefill = sorted(i for i, r in _ids(cluster.cluster()).items() if r == "prefill")[0]
        loader, results = _load_in_background(cluster, model, 60,
                                              concurrency=20, max_tokens=(30, 60))
        time.sleep(0.7)
        to_decode = _wait_flip(cluster, _flip(cluster, prefill, "decode"))
        time.sleep(0.3)
        to_prefill = _wait_flip(cluster, _flip(cluster, prefill, "prefill"))
        loader.join()
        assert _check_outcomes(results["out"], allow_errors=False) == (60, 0)
        for record in (to_decode, to_prefill):
            print(f"flip {record['from_role']}->{record['to_role']}: drain "
                  f"{record['drain_seconds'] * 1e3:.1f} ms, switch "
                  f"{record['switch_seconds'] * 1e3:.3f} ms")
            assert record["switch_seconds"] < record["drain_seconds"] + 1.0
        assert _ids(cluster.cluster())[prefill] == "prefill"
        bad = httpx.post(cluster.url + "/cluster/flip", json={"instance_id": "nope",
                                                              "role": "decode"}, timeout=10)
        assert bad.status_code == 400
    finally:
        cluster.stop()


def test_a_migrating_flip_hands_the_decodes_on_and_loses_no_token(tmp_path, tiny):
    """--flip-drain migrate: a decode instance flipped to prefill mid-load hands its running
    sequences back; their gateway runs each again from prompt + generated tokens elsewhere,
    and every request still gets exactly the tokens it asked for."""
    cluster = Cluster("--model", tiny, "--prefill", "1", "--decode", "2", "--kv-memory-gib",
                      "0.1", "--flip-drain", "migrate", log_dir=tmp_path)
    try:
        model = _served(cluster)
        loader, results = _load_in_background(cluster, model, 40,
                                              concurrency=16, max_tokens=(150, 250))
        deadline, busy = time.monotonic() + 60, None
        while busy is None and time.monotonic() < deadline:
            held = [(running, i) for i, _, running in _held(cluster.cluster())
                    if i.startswith("decode") and running >= 2]
            busy = max(held)[1] if held else None
            time.sleep(0.05)
        assert busy is not None, "no decode instance ever held two sequences"
        record = _wait_flip(cluster, _flip(cluster, busy, "prefill"))
        loader.join()
        assert _check_outcomes(results["out"], allow_errors=False) == (40, 0)
        assert record["num_migrated"] >= 2  # it held at least two when the flip was asked
        assert _ids(cluster.cluster())[busy] == "prefill"
        assert _wait_idle(cluster) == []  # no KV block or sequence left held anywhere
    finally:
        cluster.stop()


def test_redis_restart_during_load(tmp_path, tiny):
    try:
        server = RedisServer()
    except FileNotFoundError:
        pytest.skip("redis-server is not installed")
    cluster = Cluster("--model", tiny, "--redis", server.url, "--kv-memory-gib", "0.1",
                      log_dir=tmp_path)
    try:
        model = _served(cluster)
        # Long enough to outlast the restart (60 requests of 40-80 tokens: the faster kernels
        # finished the load while Redis was down).
        loader, results = _load_in_background(cluster, model, 80,
                                              concurrency=10, max_tokens=(200, 400))
        time.sleep(0.5)
        server.kill()
        time.sleep(2.0)
        server.start()
        assert loader.is_alive(), "the load ended before Redis came back"
        loader.join()
        assert _check_outcomes(results["out"], allow_errors=False) == (80, 0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and httpx.get(cluster.url + "/health").status_code != 200:
            time.sleep(0.2)
        import redis

        # Instances report every 100 ms and reconnect with backoff: wait for their next reports.
        store = redis.Redis.from_url(server.url)
        keys = []
        while time.monotonic() < deadline + 10 and len(keys) < 2:
            keys = store.keys("splitserve:inst:*")
            time.sleep(0.1)
        assert len(keys) == 2, "instances registered again after the restart"
        assert _wait_idle(cluster) == []
    finally:
        cluster.stop()
        server.stop()
