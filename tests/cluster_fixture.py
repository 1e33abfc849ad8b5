"""Start a real `splitserve up` cluster (gateway + instance processes) for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
