"""Transfer over TCP with ZeroMQ: a server thread answers block reads and writes.

Server (every instance): a ROUTER socket. A read names block ids; the reply is a header and one
frame holding those blocks gathered into [layers, 2, n, block_size, kv_heads, head_dim], sent
without copying the gathered buffer again. A write carries such a frame, which the server copies
into the named blocks. Client (the transferring instance's worker thread): one DEALER socket per
peer; a reply is matched to its request by a sequence number, so a late reply to a timed-out
transfer is discarded.
"""

from __future__ import annotations

import threading
import time

import msgspec
import torch
import zmq

from common.messaging import advertised, bind_address
from common.security import guard_context, load_keys
from kv_transfer.base import KVTransferBackend, TransferError, TransferJob

PREFIX = "tcp://"
_POLL_MS = 100


class _ReadRequest(msgspec.Struct):
    seq: int
    block_ids: list[int]
    write: bool = False  # a second frame carries the blocks to store


class _ReadReply(msgspec.Struct):
    seq: int
    ok: bool
    error: str = ""


class TcpBackend(KVTransferBackend):
    name = "tcp"

    def __init__(self, kv_cache, host, config) -> None:
        super().__init__(kv_cache, host, config)
        self._ctx = zmq.Context.instance()
        self._keys = load_keys(config.cluster_secret_file)
        self._server = self._ctx.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            guard_context(self._ctx, self._keys)
            self._keys.serve(self._server)
        self._server.bind(bind_address(host, config.port))
        self._endpoint = advertised(self._server.getsockopt_string(zmq.LAST_ENDPOINT),
                                    config.advertise_host)
        self._stop = threading.Event()
        self._server_thread = threading.Thread(target=self._serve, name="kv-tcp-server",
                                               daemon=True)
        self._clients: dict[str, zmq.Socket] = {}  # used by the worker thread only
        self._seq = 0

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def start(self) -> None:
        self._server_thread.start()
        super().start()

    # -- server side ---------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._server.poll(_POLL_MS):
                continue
            frames = self._server.recv_multipart(copy=False)
            self._answer(frames[0].bytes, frames[1].bytes, frames[2:])
        self._server.close(0)

    def _answer(self, identity: bytes, payload: bytes, data: list) -> None:
        try:
            request = msgspec.msgpack.decode(payload, type=_ReadRequest)
        except msgspec.DecodeError:
            return
        try:
            index = torch.tensor(request.block_ids, dtype=torch.long)
            if request.write:
                self.kv_cache.tensor.index_copy_(2, index, self._frame_tensor(
                    data[0], len(request.block_ids)))
                frames = [msgspec.msgpack.encode(_ReadReply(request.seq, True))]
            else:
                gathered = self.kv_cache.tensor.index_select(2, index)
                frames = [msgspec.msgpack.encode(_ReadReply(request.seq, True)),
                          gathered.view(torch.uint8).numpy()]
        except (IndexError, RuntimeError, ValueError) as exc:
            frames = [msgspec.msgpack.encode(_ReadReply(request.seq, False, str(exc)))]
        self._server.send_multipart([identity, *frames], copy=False)

    def _frame_tensor(self, frame, num_blocks: int) -> torch.Tensor:
        """A received frame viewed as [layers, 2, num_blocks, block_size, KVH, D] (no copy)."""
        layout = self.kv_cache.layout
        shape = (*layout.shape[:2], num_blocks, *layout.shape[3:])
        data = torch.frombuffer(frame.buffer, dtype=torch.uint8)
        return data.view(self.kv_cache.tensor.dtype).view(shape)

    # -- client side (worker thread) -----------------------------------------------------------
    def _client(self, endpoint: str) -> zmq.Socket:
        sock = self._clients.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self._keys is not None:
                self._keys.connect(sock)
            sock.connect(endpoint)
            self._clients[endpoint] = sock
        return sock

    def _drop_client(self, endpoint: str) -> None:
        sock = self._clients.pop(endpoint, None)
        if sock is not None:
            sock.close(0)

    def _request(self, job: TransferJob, frames: list) -> list:
        self._seq += 1
        sock = self._client(job.endpoint)
        header = _ReadRequest(self._seq, job.remote_block_ids, job.write)
        sock.send_multipart([msgspec.msgpack.encode(header), *frames], copy=False)
        reply_frames = self._await_reply(sock, job)
        reply = msgspec.msgpack.decode(reply_frames[0].bytes, type=_ReadReply)
        if not reply.ok:
            raise TransferError(f"peer refused the transfer: {reply.error}")
        return reply_frames

    def _read(self, job: TransferJob) -> int:
        if not job.endpoint.startswith(PREFIX):
            raise ValueError(f"not a TCP endpoint: {job.endpoint}")
        frames = self._request(job, [])
        data = self._frame_tensor(frames[1], len(job.remote_block_ids))
        index = torch.tensor(job.local_block_ids, dtype=torch.long)
        self.kv_cache.tensor.index_copy_(2, index, data)
        return data.numel() * data.element_size()

    def _write(self, job: TransferJob) -> int:
        if not job.endpoint.startswith(PREFIX):
            raise ValueError(f"not a TCP endpoint: {job.endpoint}")
        index = torch.tensor(job.local_block_ids, dtype=torch.long)
        gathered = self.kv_cache.tensor.index_select(2, index)
        self._request(job, [gathered.view(torch.uint8).numpy()])
        return gathered.numel() * gathered.element_size()

    def _await_reply(self, sock: zmq.Socket, job: TransferJob) -> list:
        """The reply to this request; waits in short slices so a cancelled job (its request was
        aborted, or its peer declared dead) stops waiting at once."""
        while True:
            remaining = job.deadline - time.monotonic()
            if remaining <= 0 or self.cancelled(job.request_id):
                self._drop_client(job.endpoint)  # a fresh socket next time, no stale replies
                raise TimeoutError(f"no reply from {job.endpoint} before the deadline"
                                   if remaining <= 0 else "cancelled while waiting")
            if not sock.poll(int(min(remaining, _POLL_MS / 1000) * 1000)):
                continue
            frames = sock.recv_multipart(copy=False)
            if msgspec.msgpack.decode(frames[0].bytes, type=_ReadReply).seq == self._seq:
                return frames

    def close(self) -> None:
        self._stop.set()
        super().close()
        if self._server_thread.is_alive():
            self._server_thread.join(timeout=2)
        for endpoint in list(self._clients):
            self._drop_client(endpoint)
