"""The ucx backend: one clear line when its library is missing; where ucx-py or ucxx imports, it
moves exactly the named blocks and fails by the deadline, never hangs, when the peer cannot answer.

`make test` installs ucxx (`ucxx-cu12`, the project's `ucx` extra, pulled in by `dev`): real
wheels with libucx inside that run without a GPU. The library tests skip, with the import error
as the reason, only where neither `ucp` (ucx-py) nor `ucxx` imports (no Linux wheel, Python < 3.11).
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import time

import pytest
import torch

from common.config import TransferConfig
from common.engine.kv_cache import KVCache, KVLayout
from common.transfer import ReadJob, make_backend
from kv_transfer.ucx import UcxBackend, UcxUnavailable, _Loop, import_ucx
from transfer_helpers import wait_results

# The same transports on every machine: UCX's default ("all") would pick RDMA or CUDA copies
# where a NIC or GPU is present and test another path than CI's. UCX reads this when its context
# starts (the first UCX call, after collection); the server process inherits it. setdefault: a
# developer may set UCX_TLS to test another transport.
os.environ.setdefault("UCX_TLS", "tcp,self,sm")

LAYOUT = KVLayout(num_layers=3, num_blocks=32, block_size=4, num_kv_heads=2, head_dim=8,
                  dtype="bfloat16")
wait_results = functools.partial(wait_results, timeout=15.0)


def test_missing_library_is_reported_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ucp", None)  # None in sys.modules makes the import fail
    monkeypatch.setitem(sys.modules, "ucxx", None)
    cache = KVCache(LAYOUT)
    with pytest.raises(UcxUnavailable) as caught:
        make_backend("ucx", cache, "127.0.0.1", TransferConfig(backend="ucx"))
    message = str(caught.value)
    assert message.startswith("the ucx backend needs ucx-py")
    assert "import ucp failed" in message and "import ucxx failed" in message
    assert "\n" not in message


def test_refuses_a_cluster_secret_it_cannot_honour(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    config = TransferConfig(backend="ucx", cluster_secret_file=str(secret))
    with pytest.raises(ValueError, match="cannot authenticate"):
        UcxBackend(KVCache(LAYOUT), "127.0.0.1", config)


@pytest.fixture(scope="module")
def ucx_library():
    try:
        return import_ucx()
    except UcxUnavailable as exc:
        pytest.skip(str(exc))


def make_pair(layout_a=LAYOUT, layout_b=LAYOUT):
    source, target = KVCache(layout_a), KVCache(layout_b)
    source.tensor.normal_()
    config = TransferConfig(backend="ucx")
    serve, read = UcxBackend(source, "127.0.0.1", config), UcxBackend(target, "127.0.0.1", config)
    serve.start()
    read.start()
    return serve, read, source, target


@pytest.fixture
def pair(ucx_library):
    serve, read, source, target = make_pair()
    yield serve, read, source, target
    read.close()
    serve.close()


def test_read_copies_exactly_the_named_blocks(pair):
    serve, read, source, target = pair
    remote, local = [3, 4, 5, 9, 17], [0, 1, 7, 8, 2]
    read.submit(ReadJob("r1", serve.endpoint, remote, local, time.monotonic() + 10))
    [result] = wait_results(read, 1)
    assert result.ok, result.error
    assert result.num_bytes == len(remote) * LAYOUT.bytes_per_block
    for r, l in zip(remote, local):
        assert torch.equal(target.tensor[:, :, l], source.tensor[:, :, r])
    untouched = [b for b in range(LAYOUT.num_blocks) if b not in local]
    assert not target.tensor[:, :, untouched].any()


def test_write_pushes_local_blocks_into_the_peer(pair):
    serve, read, source, target = pair
    target.tensor.normal_()
    read.submit(ReadJob("w1", serve.endpoint, [20, 21, 5], [1, 2, 3], time.monotonic() + 10,
                        write=True))
    [result] = wait_results(read, 1)
    assert result.ok, result.error
    for remote, local in zip([20, 21, 5], [1, 2, 3]):
        assert torch.equal(source.tensor[:, :, remote], target.tensor[:, :, local])


def test_out_of_range_blocks_are_refused_and_the_link_still_works(pair):
    serve, read, source, target = pair
    read.submit(ReadJob("bad", serve.endpoint, [LAYOUT.num_blocks], [0], time.monotonic() + 10))
    read.submit(ReadJob("good", serve.endpoint, [1], [0], time.monotonic() + 10))
    bad, good = wait_results(read, 2)
    assert not bad.ok and "refused" in bad.error
    assert good.ok, good.error
    assert torch.equal(target.tensor[:, :, 0], source.tensor[:, :, 1])


def test_peer_with_another_layout_is_refused(ucx_library):
    other = KVLayout(3, 32, 4, 2, 16, "bfloat16")  # head_dim differs
    serve, read, source, target = make_pair(other, LAYOUT)
    try:
        read.submit(ReadJob("r", serve.endpoint, [1], [1], time.monotonic() + 10))
        [result] = wait_results(read, 1)
        assert not result.ok and "layout" in result.error
        assert not target.tensor.any()
    finally:
        read.close()
        serve.close()


def test_unreachable_peer_fails_by_deadline(pair):
    serve, read, source, target = pair
    started = time.monotonic()
    read.submit(ReadJob("r3", "ucx://127.0.0.1:1", [1], [1], time.monotonic() + 1.0))
    [result] = wait_results(read, 1)
    assert not result.ok
    assert time.monotonic() - started < 4


def test_silent_peer_fails_by_deadline_or_cancel_then_the_next_job_succeeds(ucx_library, pair):
    serve, read, source, target = pair
    loop = _Loop.get()
    release = {}

    async def silent(ep):  # accepts, then never answers
        await release["event"].wait()

    async def listen():
        release["event"] = asyncio.Event()
        return ucx_library.create_listener(silent)

    listener = loop.run(listen(), timeout=10)
    silent_endpoint = f"ucx://127.0.0.1:{listener.port}"
    try:
        started = time.monotonic()
        read.submit(ReadJob("hang", silent_endpoint, [1], [1], time.monotonic() + 1.0))
        read.submit(ReadJob("cancel", silent_endpoint, [1], [1], time.monotonic() + 30))
        read.submit(ReadJob("after", serve.endpoint, [2], [2], time.monotonic() + 10))
        [hang] = wait_results(read, 1)
        assert not hang.ok and "deadline" in hang.error
        time.sleep(0.3)  # the second job is now waiting on the silent peer
        read.cancel("cancel")
        cancelled, after = wait_results(read, 2)
        assert not cancelled.ok and "cancelled" in cancelled.error
        assert time.monotonic() - started < 8  # neither waited for the 30 s deadline
        assert after.ok, after.error
        assert torch.equal(target.tensor[:, :, 2], source.tensor[:, :, 2])
        assert not target.tensor[:, :, 1].any()  # the timed-out read wrote nothing
    finally:
        loop.loop.call_soon_threadsafe(release["event"].set)
        listener.close()


def test_killed_server_process_fails_the_read_without_hanging(ucx_library):
    from bench.transfer_throughput import check_blocks, start_server, stop_server

    process, endpoint, conn = start_server("ucx", LAYOUT)
    cache = KVCache(LAYOUT)
    read = UcxBackend(cache, "127.0.0.1", TransferConfig(backend="ucx"))
    read.start()
    try:
        read.submit(ReadJob("before", endpoint, [6, 7], [0, 1], time.monotonic() + 20))
        [before] = wait_results(read, 1, timeout=25)
        assert before.ok, before.error
        check_blocks(cache.tensor, LAYOUT, [6, 7], [0, 1])
        process.kill()
        process.join(10)
        started = time.monotonic()
        read.submit(ReadJob("after", endpoint, [6], [2], time.monotonic() + 3))
        [after] = wait_results(read, 1)
        assert not after.ok
        assert time.monotonic() - started < 8
    finally:
        read.close()
        stop_server(process, conn)
