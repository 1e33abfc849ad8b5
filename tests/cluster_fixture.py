"""Start a real `splitserve up` cluster (gateway + instance processes) for integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from common.process import free_port

ROOT = Path(__file__).resolve().parents[1]


class Cluster:
    def __init__(self, *args: str, log_dir: Path, startup_timeout: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        command = [sys.executable, "-m", "control_plane.cli", "up", "--host", "127.0.0.1",
                   "--port", str(self.port), "--log-dir", str(log_dir), *args]
        self.output = open(log_dir / "up.log", "w")
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.output,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"splitserve up exited: {(self.log_dir / 'up.log').read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError("cluster did not become healthy")

    def cluster(self) -> dict:
        return httpx.get(self.url + "/cluster", timeout=5).json()

    def instance(self, instance_id: str) -> dict:
        return next(i for i in self.cluster()["instances"] if i["instance_id"] == instance_id)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.output.close()


class GatewayProcess:
    """A second `splitserve gateway` sharing a cluster through Redis."""

    def __init__(self, *args: str, log_dir: Path, startup_timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.output = open(log_dir / f"gateway-{self.port}.log", "w")
        command = [sys.executable, "-m", "control_plane.cli", "gateway", "--host", "127.0.0.1",
                   "--port", str(self.port), "--inbox-port", str(free_port()), *args]
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.output,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError("gateway did not become healthy")

    def cluster(self) -> dict:
        return httpx.get(self.url + "/cluster", timeout=5).json()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        self.output.close()


class RedisServer:
    """A private redis-server on a free port (so a test may kill and restart it)."""

    def __init__(self) -> None:
        import shutil

        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise TimeoutError("redis-server did not start")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.kill()


async def run_load(urls: list[str], count: int, model: str, *, concurrency: int = 16,
                   max_tokens=(8, 48), stream_every: int = 2) -> list[dict]:
    """`count` completions spread over `urls`; returns one outcome dict per request."""
    import asyncio
    import json
    import random

    rng = random.Random(0)
    gate = asyncio.Semaphore(concurrency)

    async def one(client, index):
        url = urls[index % len(urls)]
        body = {"model": model, "prompt": f"Tell me about item {index}. " * rng.randint(1, 6),
                "max_tokens": rng.randint(*max_tokens), "ignore_eos": True}
        async with gate:
            if index % stream_every == 0:
                return await _stream(client, url, body)
            response = await client.post(url + "/v1/completions", json=body)
            data = response.json()
            return {"status": response.status_code, "error": data.get("error"),
                    "tokens": (data.get("usage") or {}).get("completion_tokens"),
                    "want": body["max_tokens"]}

    async def _stream(client, url, body):
        body = dict(body, stream=True, stream_options={"include_usage": True})
        outcome = {"status": None, "error": None, "tokens": None, "want": body["max_tokens"]}
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            outcome["status"] = response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    outcome["error"] = chunk.get("error", outcome["error"])
                    if chunk.get("usage") and not chunk.get("choices"):
                        outcome["tokens"] = chunk["usage"]["completion_tokens"]
        return outcome

    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(one(client, i) for i in range(count)))
