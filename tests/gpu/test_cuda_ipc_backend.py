"""The cuda_ipc backend between two processes on one GPU host: exact blocks device to device,
writes into the peer, a refused layout, and a clean failure once the peer is gone.

The serving process is spawned (torch.multiprocessing, 'spawn': CUDA cannot be forked) by
bench.transfer_throughput.start_server, which fills its cache with a pattern that tells every
element's origin, so this process checks bytes without a second copy of the peer's cache.
Skipped without CUDA (tests/conftest.py skips `gpu` tests); not yet run on a GPU.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch

from bench.transfer_throughput import check_blocks, start_server, stop_server
from common.config import TransferConfig
from common.engine.kv_cache import KVCache, KVLayout
from common.transfer import ReadJob, make_backend
from transfer_helpers import wait_results

pytestmark = pytest.mark.gpu

LAYOUT = KVLayout(num_layers=3, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64,
                  dtype="bfloat16")
wait_results = functools.partial(wait_results, timeout=30.0)


def make_reader(layout=LAYOUT):
    cache = KVCache(layout, device="cuda")
    backend = make_backend("cuda_ipc", cache, "127.0.0.1", TransferConfig(backend="cuda_ipc"))
    backend.start()
    return backend


@pytest.fixture
def served():
    process, endpoint, conn = start_server("cuda_ipc", LAYOUT, device="cuda")
    yield process, endpoint
    stop_server(process, conn)


@pytest.fixture
def reader():
    backend = make_reader()
    yield backend
    backend.close()


def test_read_copies_exactly_the_named_blocks_on_the_gpu(served, reader):
    _, endpoint = served
    remote, local = [3, 4, 5, 9, 40], [0, 1, 7, 8, 2]
    reader.submit(ReadJob("r1", endpoint, remote, local, time.monotonic() + 30))
    [result] = wait_results(reader, 1)
    assert result.ok, result.error
    assert result.num_bytes == len(remote) * LAYOUT.bytes_per_block
    tensor = reader.kv_cache.tensor
    assert tensor.is_cuda
    for r, l in zip(remote, local):
        check_blocks(tensor, LAYOUT, [r], [l])
    untouched = [b for b in range(LAYOUT.num_blocks) if b not in local]
    assert not tensor[:, :, untouched].any()


def test_write_lands_in_the_peer_and_reads_back(served, reader):
    _, endpoint = served
    tensor = reader.kv_cache.tensor
    tensor[:, :, 10:12].fill_(3.0)
    reader.submit(ReadJob("w", endpoint, [50, 51], [10, 11], time.monotonic() + 30, write=True))
    reader.submit(ReadJob("r", endpoint, [50, 51], [20, 21], time.monotonic() + 30))
    write, read = wait_results(reader, 2)
    assert write.ok and read.ok, (write.error, read.error)
    assert torch.equal(tensor[:, :, 20:22], tensor[:, :, 10:12])


def test_peer_with_another_layout_is_refused(served):
    _, endpoint = served
    other = KVLayout(3, 64, 16, 2, 32, "bfloat16")  # head_dim differs
    backend = make_reader(other)
    try:
        backend.submit(ReadJob("r", endpoint, [1], [1], time.monotonic() + 30))
        [result] = wait_results(backend, 1)
        assert not result.ok and "layout" in result.error
        assert not backend.kv_cache.tensor.any()
    finally:
        backend.close()


def test_read_from_an_exited_peer_fails_cleanly(served, reader):
    process, endpoint = served
    reader.submit(ReadJob("before", endpoint, [1], [1], time.monotonic() + 30))
    [before] = wait_results(reader, 1)
    assert before.ok, before.error
    process.kill()
    process.join(10)
    started = time.monotonic()
    reader.submit(ReadJob("after", endpoint, [2], [2], time.monotonic() + 5))
    [after] = wait_results(reader, 1)
    assert not after.ok and "exited" in after.error
    assert time.monotonic() - started < 5
    assert not reader.kv_cache.tensor[:, :, 2].any()
