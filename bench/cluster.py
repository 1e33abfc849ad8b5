"""Start and stop a `splitserve up` cluster from an experiment (a subprocess per cluster)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from common.process import die_with_parent, free_port


class ClusterProcess:
    """`splitserve up ARGS` on a free port; `stop()` ends it and every instance."""

    def __init__(self, args: list[str], log_path: Path, startup_timeout_s: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "control_plane.cli", "up", "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent)  # and `up` stops its instances on SIGTERM
        self._wait_healthy(startup_timeout_s, log_path)

    def _wait_healthy(self, timeout_s: float, log_path: Path) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"the cluster exited during start-up; see {log_path}")
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"the cluster did not become healthy; see {log_path}")

    def cluster(self) -> dict:
        return httpx.get(self.url + "/cluster", timeout=10).json()

    def model(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()

    def __enter__(self) -> ClusterProcess:
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()
