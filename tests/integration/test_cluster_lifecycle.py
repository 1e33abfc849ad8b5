"""`splitserve up` over shared memory, and shutdown: nothing is left running or held."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
from cluster_fixture import Cluster

MODEL = "SmolLM2-135M-Instruct"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


async def _requests(url: str, count: int) -> list[int]:
    async with httpx.AsyncClient(timeout=120) as client:
        responses = await asyncio.gather(*(client.post(url + "/v1/completions", json={
            "model": MODEL, "prompt": f"Fact {i}:", "max_tokens": 12, "ignore_eos": True})
            for i in range(count)))
    return [r.json()["usage"]["completion_tokens"] for r in responses]


def test_shared_memory_transfer_serves_and_frees(tmp_path):
    cluster = Cluster("--transfer", "shm", log_dir=tmp_path)
    try:
        instances = cluster.cluster()["instances"]
        assert all(i["kv_endpoint"].startswith("shm:///proc/") for i in instances)
        assert asyncio.run(_requests(cluster.url, 8)) == [12] * 8
        time.sleep(0.5)
        assert all(i["kv_blocks"]["used"] == 0 for i in cluster.cluster()["instances"])
    finally:
        cluster.stop()


def test_sigint_stops_every_instance(tmp_path):
    cluster = Cluster(log_dir=tmp_path)
    pids = [i["pid"] for i in cluster.cluster()["instances"]]
    os.kill(cluster.process.pid, signal.SIGINT)  # only the parent, as `kill -INT` would
    cluster.process.wait(30)
    assert _wait_gone(pids) == []
    cluster.stop()


def test_instances_die_with_a_killed_parent(tmp_path):
    cluster = Cluster(log_dir=tmp_path)
    pids = [i["pid"] for i in cluster.cluster()["instances"]]
    os.kill(cluster.process.pid, signal.SIGKILL)
    cluster.process.wait(10)
    assert _wait_gone(pids) == []
    cluster.stop()
