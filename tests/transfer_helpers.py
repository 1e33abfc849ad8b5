"""Shared by the KV transfer tests of every tier (unit, gpu): waiting on a backend's results."""

from __future__ import annotations

import time


def wait_results(backend, count: int, timeout: float = 10.0) -> list:
    """Poll `backend` until `count` results came back or `timeout` seconds passed."""
    results, deadline = [], time.monotonic() + timeout
    while len(results) < count and time.monotonic() < deadline:
        results += backend.poll()
        time.sleep(0.005)
    return results
