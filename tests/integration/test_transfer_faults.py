"""KV transfer faults: receiver or sender killed mid-transfer, a transfer that never completes.

Every request completes or ends with an error event, nothing hangs, and no KV block stays held
on a live instance. Transfers are slowed with the emulated link (OPT-13B byte counts) so a kill
lands while they are in flight, and every request takes that path (`--local-prefill off`: no
prefill on a decode instance). Tiny random-weight model, real processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest
from cluster_fixture import Cluster, run_load

SLOW_LINK = ["--emulate-bandwidth", "4e7", "--emulate-bytes-per-token", "819200"]


def _served(cluster) -> str:
    return httpx.get(cluster.url + "/v1/models", timeout=5).json()["data"][0]["id"]


def _wait_idle(cluster, timeout=30.0) -> list:
    deadline = time.monotonic() + timeout
    held = []
    while time.monotonic() < deadline:
        held = [(i["instance_id"], i["kv_blocks"]["used"], i["queue"])
                for i in cluster.cluster()["instances"]
                if i["ready"] and (i["kv_blocks"]["used"] or i["queue"]["running"]
                                   or i["queue"]["transferring"])]
        if not held:
            return []
        time.sleep(0.2)
    return held


def _kill_when_transferring(cluster, role: str, result: dict) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for inst in cluster.cluster()["instances"]:
            if inst["role"] == role and inst["queue"]["transferring"] > 0:
                os.kill(inst["pid"], signal.SIGKILL)
                result["killed"] = inst["instance_id"]
                return
        time.sleep(0.05)


def _run_with_kill(cluster, role: str, count: int) -> tuple[list, dict]:
    result: dict = {}
    killer = threading.Thread(target=_kill_when_transferring, args=(cluster, role, result))
    killer.start()
    outcomes = asyncio.run(run_load([cluster.url], count, _served(cluster), concurrency=count,
                                    max_tokens=(8, 16), stream_every=1))
    killer.join()
    assert "killed" in result, "no transfer was in flight to interrupt"
    return outcomes, result


@pytest.fixture
def tiny(tiny_models):
    return str(tiny_models["llama"])


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_receiver_killed_mid_transfer(tmp_path, tiny, policy):
    recovery = [] if policy == "recompute" else ["--max-recoveries", "0"]
    cluster = Cluster("--model", tiny, "--decode", "2", "--kv-memory-gib", "0.05",
                      "--instance-timeout", "1.0", "--transfer-failure-policy", policy,
                      *recovery, *SLOW_LINK, "--local-prefill", "off", log_dir=tmp_path)
    try:
        outcomes, result = _run_with_kill(cluster, "decode", 6)
        errors = [o for o in outcomes if o["error"]]
        assert all(o["status"] == 200 for o in outcomes)
        if policy == "recompute":
            assert errors == [] and all(o["tokens"] == o["want"] for o in outcomes)
        else:
            assert errors, "requests on the killed instance end with an error event"
            assert all(o["tokens"] == o["want"] for o in outcomes if not o["error"])
        assert _wait_idle(cluster) == []
    finally:
        cluster.stop()


def test_sender_killed_mid_transfer(tmp_path, tiny):
    cluster = Cluster("--model", tiny, "--prefill", "2", "--kv-memory-gib", "0.05",
                      "--instance-timeout", "1.0", *SLOW_LINK, "--local-prefill", "off",
                      log_dir=tmp_path)
    try:
        outcomes, result = _run_with_kill(cluster, "prefill", 6)
        assert all(o["status"] == 200 and not o["error"] and o["tokens"] == o["want"]
                   for o in outcomes), outcomes
        assert _wait_idle(cluster) == []
    finally:
        cluster.stop()


def test_stalled_transfer_fails_at_its_timeout_without_leaks(tmp_path, tiny):
    cluster = Cluster("--model", tiny, "--kv-memory-gib", "0.05", "--transfer-fault", "stall",
                      "--transfer-timeout", "2", "--transfer-failure-policy", "fail",
                      "--max-recoveries", "0", "--local-prefill", "off", log_dir=tmp_path)
    try:
        started = time.monotonic()
        outcomes = asyncio.run(run_load([cluster.url], 4, _served(cluster), concurrency=4,
                                        max_tokens=(8, 16), stream_every=1))
        assert all(o["status"] == 200 and o["error"] for o in outcomes), outcomes
        assert "KV transfer failed" in outcomes[0]["error"]["message"]
        assert time.monotonic() - started < 20, "failed at the transfer timeout, not later"
        assert _wait_idle(cluster) == []
    finally:
        cluster.stop()
