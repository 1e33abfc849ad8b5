"""Transfer over UCX (ucx-py or ucxx): a listener answers block reads and writes, as tcp.py does.

This module owns the "ucx" backend. UCX picks the transport per peer: RDMA (verbs) where a NIC
has it, shared memory or CMA on one host, TCP otherwise; `UCX_TLS` pins it (`UCX_TLS=tcp`).

Server: a UCX listener; each connected peer gets a handler that answers its requests in order. A
request is a msgpack header naming block ids and the client's block layout (another layout is
refused, not fed wrong bytes); a read is answered by a reply header and one message holding the
blocks gathered into [layers, 2, n, block_size, kv_heads, head_dim]; a write sends that message
after its header. Client: one endpoint per peer; a request that fails, is cancelled or runs past
its deadline aborts the endpoint, so no late reply is taken for the next request's, and a
restarted peer is reached through a fresh endpoint.

The library is asyncio-only and its context is process-wide, bound to the loop that first used
it: every UCX call of this process runs on one loop thread (`_Loop`) and the job thread waits
on it. Received bytes land in a scratch buffer and are copied into the cache on the job
thread once the request has finished, so a timed-out request never writes into blocks the
caller has since freed (the base class's contract).

ucx-py (`import ucp`) does not install here (its PyPI wheels are stubs that download from
another index); its successor ucxx (`ucxx-cu12` on PyPI: same asyncio API, runs without a GPU)
does, and is used when `ucp` is missing. With neither, constructing the backend raises one line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import threading
import time

import msgspec
import torch

from kv_transfer.base import ThreadedBackend, TransferError, TransferJob

PREFIX = "ucx://"
_LIBRARIES = ("ucp", "ucxx")  # ucx-py, then its successor with the same API


class UcxUnavailable(RuntimeError):
    """The UCX library cannot be imported; the message is one line for the start-up log."""


def import_ucx():
    """The first importable UCX binding, or UcxUnavailable saying why none is."""
    errors = []
    for name in _LIBRARIES:
        try:
            return importlib.import_module(name)
        except Exception as exc:  # a broken install raises more than ImportError (missing .so)
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
            errors.append(f"import {name} failed: {first_line}")
    raise UcxUnavailable(f"the ucx backend needs ucx-py or ucxx ({'; '.join(errors)})")


class _Request(msgspec.Struct):
    seq: int
    block_ids: list[int]
    block_layout: list  # the client's [layers, 2, block_size, kv_heads, head_dim, dtype]
    write: bool = False


class _Reply(msgspec.Struct):
    seq: int
    ok: bool
    error: str = ""


class _Loop:
    """The process's one asyncio loop for UCX calls, on a daemon thread."""

    _instance: _Loop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="ucx-loop", daemon=True).start()

    @classmethod
    def get(cls) -> _Loop:
        with cls._lock:
            cls._instance = cls._instance or _Loop()
            return cls._instance

    def run(self, coro, timeout: float, stop=lambda: False):
        """The coroutine's result, waiting at most `timeout` s; `stop()` is checked every 100 ms
        so a cancelled job stops waiting at once."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(min(max(deadline - time.monotonic(), 0.0), 0.1))
            except concurrent.futures.TimeoutError:
                expired = time.monotonic() >= deadline
                if expired or stop():
                    future.cancel()
                    raise TimeoutError("the UCX request ran past its deadline" if expired
                                       else "cancelled while waiting") from None


def _is_closed(ep) -> bool:
    closed = ep.closed  # a method in ucx-py, a property in ucxx
    return closed() if callable(closed) else bool(closed)


def _as_bytes(tensor: torch.Tensor):
    """A uint8 numpy view (no copy): UCX takes the buffer protocol, torch has none, numpy has
    no bfloat16."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


class UcxBackend(ThreadedBackend):
    name = "ucx"

    def __init__(self, kv_cache, host, config) -> None:
        if config.cluster_secret_file:
            raise ValueError("the ucx backend cannot authenticate peers (no CurveZMQ in UCX): "
                             "use the tcp backend with a cluster secret")
        self._ucx = import_ucx()  # before anything else, so the one error reported says why
        # ucx-py roots its errors at UCXBaseException (its UCXCloseError is no UCXError)
        errors = self._ucx.exceptions
        self._ucx_error = getattr(errors, "UCXBaseException", errors.UCXError)
        super().__init__(kv_cache, host, config)
        self._loop = _Loop.get()
        layout = kv_cache.layout
        self._layout = [layout.num_layers, 2, layout.block_size, layout.num_kv_heads,
                        layout.head_dim, layout.dtype]
        self._closed = False
        self._served: set = set()  # server-side endpoints (loop thread only)
        self._endpoints: dict[str, object] = {}  # client endpoints by peer (loop thread only)
        self._seq = 0
        self._listener = self._loop.run(self._listen(config.port), timeout=30)
        self._endpoint = f"{PREFIX}{config.advertise_host or host}:{self._listener.port}"

    @property
    def endpoint(self) -> str:
        return self._endpoint

    # -- server side (loop thread) ----------------------------------------------------------------
    async def _listen(self, port: int):
        # UCX listens on every interface; peers are told the advertised or configured host.
        return self._ucx.create_listener(self._serve_peer, port or None)

    async def _serve_peer(self, ep) -> None:
        self._served.add(ep)
        try:
            while not self._closed:
                request = msgspec.msgpack.decode(await ep.recv_obj(), type=_Request)
                await self._answer(ep, request)
        except (self._ucx_error, msgspec.DecodeError, asyncio.CancelledError):
            pass  # the peer closed, died or spoke nonsense: stop serving this endpoint
        finally:
            self._served.discard(ep)
            ep.abort()

    async def _answer(self, ep, request: _Request) -> None:
        refusal = ("" if request.block_layout == self._layout else
                   f"block layout {request.block_layout} differs from this cache's {self._layout}")
        index = torch.tensor(request.block_ids, dtype=torch.long)
        nbytes = len(request.block_ids) * self.kv_cache.layout.bytes_per_block
        if request.write:
            data = torch.empty(nbytes, dtype=torch.uint8)
            await ep.recv(data.numpy())  # taken even when refused, to stay in step with the peer
            try:
                if not refusal:
                    self.kv_cache.tensor.index_copy_(2, index, self._blocks_view(data, len(index)))
            except (IndexError, RuntimeError) as exc:
                refusal = f"{type(exc).__name__}: {exc}"
            await ep.send_obj(msgspec.msgpack.encode(_Reply(request.seq, not refusal, refusal)))
            return
        gathered = None
        if not refusal:
            try:
                gathered = self.kv_cache.tensor.index_select(2, index)
            except (IndexError, RuntimeError) as exc:
                refusal = f"{type(exc).__name__}: {exc}"
        await ep.send_obj(msgspec.msgpack.encode(_Reply(request.seq, not refusal, refusal)))
        if gathered is not None:
            await ep.send(_as_bytes(gathered))

    def _blocks_view(self, data: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """Raw bytes viewed as [layers, 2, num_blocks, block_size, KVH, D] (no copy)."""
        layout = self.kv_cache.layout
        shape = (*layout.shape[:2], num_blocks, *layout.shape[3:])
        return data.view(self.kv_cache.tensor.dtype).view(shape)

    # -- client side: the job thread waits on coroutines run by the loop thread --------------------
    def _read(self, job: TransferJob) -> int:
        data = self._call(job, self._exchange(job, None))
        index = torch.tensor(job.local_block_ids, dtype=torch.long)
        self.kv_cache.tensor.index_copy_(2, index, self._blocks_view(data, len(index)))
        return data.numel()

    def _write(self, job: TransferJob) -> int:
        index = torch.tensor(job.local_block_ids, dtype=torch.long)
        gathered = self.kv_cache.tensor.index_select(2, index)
        self._call(job, self._exchange(job, gathered))
        return gathered.numel() * gathered.element_size()

    def _call(self, job: TransferJob, coro):
        if not job.endpoint.startswith(PREFIX):
            coro.close()
            raise ValueError(f"not a UCX endpoint: {job.endpoint}")
        try:
            return self._loop.run(coro, max(job.deadline - time.monotonic(), 0.0),
                                  stop=lambda: self.cancelled(job.request_id))
        except BaseException:
            # Whatever state the endpoint is in (a reply may still come), it is not reused.
            self._loop.run(self._drop(job.endpoint), timeout=5)
            raise

    async def _exchange(self, job: TransferJob, outgoing: torch.Tensor | None):
        """One request on the peer's endpoint; returns the received bytes for a read."""
        ep = await self._connect(job)
        self._seq += 1
        request = _Request(self._seq, job.remote_block_ids, self._layout, outgoing is not None)
        await ep.send_obj(msgspec.msgpack.encode(request))
        if outgoing is not None:
            await ep.send(_as_bytes(outgoing))
        reply = msgspec.msgpack.decode(await ep.recv_obj(), type=_Reply)
        if reply.seq != request.seq:
            raise TransferError(f"reply {reply.seq} answers no request of ours ({request.seq})")
        if not reply.ok:
            raise TransferError(f"peer refused the transfer: {reply.error}")
        if outgoing is not None:
            return None
        incoming = torch.empty(len(job.remote_block_ids) * self.kv_cache.layout.bytes_per_block,
                               dtype=torch.uint8)
        await ep.recv(incoming.numpy())
        return incoming

    async def _connect(self, job: TransferJob):
        ep = self._endpoints.get(job.endpoint)
        if ep is None or _is_closed(ep):
            host, _, port = job.endpoint.removeprefix(PREFIX).rpartition(":")
            # wait_for, not connect_timeout=: ucx-py's create_endpoint has no such argument.
            ep = await asyncio.wait_for(self._ucx.create_endpoint(host, int(port)),
                                        max(job.deadline - time.monotonic(), 0.1))
            self._endpoints[job.endpoint] = ep
        return ep

    async def _drop(self, endpoint: str) -> None:
        ep = self._endpoints.pop(endpoint, None)
        if ep is not None:
            ep.abort()  # cancels its outstanding requests before their buffers are released

    async def _shutdown(self) -> None:
        self._closed = True
        for endpoint in list(self._endpoints):
            await self._drop(endpoint)
        for ep in list(self._served):
            ep.abort()
        self._listener.close()

    def close(self) -> None:
        super().close()  # the job thread first: it may be waiting on the loop
        self._loop.run(self._shutdown(), timeout=10)
