"""The cuda_ipc handle service runs on the shared server thread without a GPU: a peer asks, the
service answers with its handle (or the one-line error of a failed export), and a peer that
never answers fails by the deadline. The GPU copy itself is tests/gpu/test_cuda_ipc_backend.py."""

from __future__ import annotations

import time

import pytest

from common.config import TransferConfig
from common.engine.kv_cache import KVCache, KVLayout
from kv_transfer.base import ServedBackend, TransferError
from kv_transfer.cuda_ipc import CudaIpcBackend, _Handle

LAYOUT = KVLayout(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=4,
                  dtype="float32")
HANDLE = _Handle("host", 1, 2, "GPU-0", "float32", [1, 2, 4, 2, 1, 4], [1, 1, 1, 1, 1, 1], 0,
                 b"storage", 64, 0, b"ref", 0, None, False)


class _ServiceOnly(CudaIpcBackend):
    """CudaIpcBackend minus its CUDA checks, exporting a fixed handle (or failing to)."""

    def __init__(self, kv_cache, host, config, export_error: str = "") -> None:
        ServedBackend.__init__(self, kv_cache, host, config)
        self._peers = {}
        self._export_error = export_error

    def _export(self) -> _Handle:
        if self._export_error:
            raise RuntimeError(self._export_error)
        return HANDLE


@pytest.fixture
def services():
    config = TransferConfig(backend="cuda_ipc")
    made = [_ServiceOnly(KVCache(LAYOUT), "127.0.0.1", config),
            _ServiceOnly(KVCache(LAYOUT), "127.0.0.1", config, export_error="CUDA error: boom")]
    for service in made:
        service.start()
    yield made
    for service in made:
        service.close()


def test_a_peer_gets_the_handle_or_the_export_error(services):
    good, bad = services
    assert good.endpoint.startswith("cuda_ipc://tcp://127.0.0.1:")
    assert bad._fetch_handle(good.endpoint, time.monotonic() + 5) == HANDLE
    with pytest.raises(TransferError, match="could not export its cache: CUDA error: boom"):
        good._fetch_handle(bad.endpoint, time.monotonic() + 5)


def test_a_silent_peer_fails_by_the_deadline(services):
    good, _ = services
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        good._fetch_handle("cuda_ipc://tcp://127.0.0.1:1", time.monotonic() + 0.3)
    assert time.monotonic() - started < 2
