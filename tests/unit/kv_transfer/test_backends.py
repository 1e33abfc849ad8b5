"""Both transfer backends move exactly the named blocks, and fail cleanly when the peer can't."""

from __future__ import annotations

import time

import pytest
import torch

from common.config import TransferConfig
from common.engine.kv_cache import KVCache, KVLayout
from common.transfer import ReadJob, TransferStatus, make_backend
from kv_transfer.base import copy_blocks
from transfer_helpers import wait_results

LAYOUT = KVLayout(num_layers=3, num_blocks=32, block_size=4, num_kv_heads=2, head_dim=8,
                  dtype="bfloat16")


@pytest.fixture(params=["tcp", "shm"])
def pair(request):
    source = KVCache(LAYOUT, shared_memory=True)
    target = KVCache(LAYOUT, shared_memory=True)
    source.tensor.normal_()
    config = TransferConfig(backend=request.param)
    serve = make_backend(request.param, source, "127.0.0.1", config)
    read = make_backend(request.param, target, "127.0.0.1", config)
    serve.start()
    read.start()
    yield serve, read, source, target
    serve.close()
    read.close()
    source.close()
    target.close()


def test_read_copies_exactly_the_named_blocks(pair):
    serve, read, source, target = pair
    remote, local = [3, 4, 5, 9, 17], [0, 1, 7, 8, 2]
    read.submit(ReadJob("r1", serve.endpoint, remote, local, time.monotonic() + 5))
    [result] = wait_results(read, 1)
    assert result.ok, result.error
    assert result.num_bytes == len(remote) * LAYOUT.bytes_per_block
    for r, l in zip(remote, local):
        assert torch.equal(target.tensor[:, :, l], source.tensor[:, :, r])
    untouched = [b for b in range(LAYOUT.num_blocks) if b not in local]
    assert not target.tensor[:, :, untouched].any()


def test_cancelled_job_reports_failure_without_writing(pair):
    serve, read, source, target = pair
    read.cancel("r2")
    read.submit(ReadJob("r2", serve.endpoint, [1], [1], time.monotonic() + 5))
    [result] = wait_results(read, 1)
    assert not result.ok and result.error == "cancelled"
    assert not target.tensor.any()


def test_unreachable_peer_fails_by_deadline(pair):
    serve, read, source, target = pair
    bad = "tcp://127.0.0.1:1" if read.name == "tcp" else "shm:///proc/999999/fd/3"
    started = time.monotonic()
    read.submit(ReadJob("r3", bad, [1], [1], time.monotonic() + 0.5))
    [result] = wait_results(read, 1)
    assert not result.ok
    assert time.monotonic() - started < 3


def test_copy_blocks_groups_runs():
    src = torch.arange(2 * 2 * 10).view(2, 2, 10).float()
    dst = torch.zeros_like(src)
    copy_blocks(src, [2, 3, 4, 8], dst, [5, 6, 7, 0])
    assert dst[:, :, 5:8].equal(src[:, :, 2:5]) and dst[:, :, 0].equal(src[:, :, 8])


def test_write_pushes_local_blocks_into_the_peer(pair):
    serve, read, source, target = pair
    target.tensor.normal_()
    job = ReadJob("w1", serve.endpoint, remote_block_ids=[20, 21, 5], local_block_ids=[1, 2, 3],
                  deadline=time.monotonic() + 5, write=True)
    read.submit(job)
    [result] = wait_results(read, 1)
    assert result.ok, result.error
    for remote, local in zip([20, 21, 5], [1, 2, 3]):
        assert torch.equal(source.tensor[:, :, remote], target.tensor[:, :, local])


def test_emulated_bandwidth_paces_delivery(pair):
    from common.config import EmulationConfig

    serve, read, source, target = pair
    read.emulation = EmulationConfig(bandwidth=1e6, latency_s=0.05, bytes_per_token=1000)
    started = time.monotonic()
    read.submit(ReadJob("e1", serve.endpoint, [1], [1], time.monotonic() + 5, num_tokens=200))
    [result] = wait_results(read, 1)
    elapsed = time.monotonic() - started
    assert result.ok
    assert elapsed >= 0.05 + 200 * 1000 / 1e6  # 0.25 s: paced, never early
    assert read.stats.num_transfers == 1 and read.stats.num_bytes == LAYOUT.bytes_per_block


def test_results_say_done_aborted_or_failed(pair):
    serve, read, source, target = pair
    read.cancel("a")
    read.submit(ReadJob("a", serve.endpoint, [1], [1], time.monotonic() + 5))
    read.submit(ReadJob("f", serve.endpoint, [99], [1], time.monotonic() + 5))  # no block 99
    read.submit(ReadJob("d", serve.endpoint, [1], [1], time.monotonic() + 5))
    statuses = {r.request_id: r.status for r in wait_results(read, 3)}
    assert statuses == {"a": TransferStatus.ABORTED, "f": TransferStatus.FAILED,
                        "d": TransferStatus.DONE}


def test_an_unknown_backend_name_lists_the_installed_ones():
    cache = KVCache(LAYOUT)
    with pytest.raises(KeyError, match="unknown KV transfer backend 'nope'; known: .*shm, tcp"):
        make_backend("nope", cache, "127.0.0.1", TransferConfig())


@pytest.mark.parametrize("pair", ["tcp"], indirect=True)
def test_a_tcp_read_larger_than_a_piece_goes_in_pieces_and_copies_exactly(pair, monkeypatch):
    """Pieces of two blocks, two requests in flight: five blocks are three requests, in order,
    and every block lands where it was asked to."""
    import kv_transfer.tcp as tcp
    serve, read, source, target = pair
    monkeypatch.setattr(tcp, "PIECE_BYTES", 2 * LAYOUT.bytes_per_block)
    asked = []
    ask = type(read)._ask
    monkeypatch.setattr(type(read), "_ask", lambda self, sock, ids, *rest: (
        asked.append(list(ids)), ask(self, sock, ids, *rest))[1])
    remote, local = [3, 4, 5, 9, 17], [0, 1, 7, 8, 2]
    read.submit(ReadJob("p1", serve.endpoint, remote, local, time.monotonic() + 5))
    [result] = wait_results(read, 1)
    assert result.ok, result.error
    assert asked == [[3, 4], [5, 9], [17]]
    assert result.num_bytes == len(remote) * LAYOUT.bytes_per_block
    for r, l in zip(remote, local):
        assert torch.equal(target.tensor[:, :, l], source.tensor[:, :, r])
    untouched = [b for b in range(LAYOUT.num_blocks) if b not in local]
    assert not target.tensor[:, :, untouched].any()
