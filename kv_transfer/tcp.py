"""Transfer over TCP with ZeroMQ: a server thread answers block reads and writes.

This module owns the "tcp" backend. Server (every instance): the ROUTER socket and thread of
`ServedBackend`. A read names block ids; the reply is a header and one frame holding those
blocks gathered into [layers, 2, n, block_size, kv_heads, head_dim], sent without copying the
gathered buffer again. A write carries such a frame, which the server copies into the named
blocks. Client (the transferring instance's job thread): one DEALER socket per peer; a reply is
matched to its request by a sequence number, so a late reply to a timed-out transfer is
discarded. A read of more than PIECE_BYTES goes as several requests of at most that many bytes,
IN_FLIGHT of them outstanding: the server gathers the next piece while this side stores the
last, and no step allocates or touches the whole prompt's KV at once (a 2-core Xeon read 48-64 MB
as one message at 0.5-0.65 GB/s, in 4 MB pieces at 1.4-1.9 GB/s: docs/kv_transfer.md).
"""

from __future__ import annotations

import time
from collections import deque

import msgspec
import torch
import zmq

from kv_transfer.base import ServedBackend, TransferError, TransferJob

PREFIX = "tcp://"
_POLL_MS = 100  # how long one wait for a reply lasts before the job's deadline is looked at
PIECE_BYTES = 4 << 20  # a read's largest request
IN_FLIGHT = 2  # requests of one read outstanding at once


class _ReadRequest(msgspec.Struct):
    seq: int
    block_ids: list[int]
    write: bool = False  # a second frame carries the blocks to store


class _ReadReply(msgspec.Struct):
    seq: int
    ok: bool
    error: str = ""


class TcpBackend(ServedBackend):
    name = "tcp"

    def __init__(self, kv_cache, host, config) -> None:
        super().__init__(kv_cache, host, config)
        self._clients: dict[str, zmq.Socket] = {}  # used by the job thread only
        self._seq = 0

    # -- server side ---------------------------------------------------------------------------
    def _answer(self, frames: list[zmq.Frame]) -> list | None:
        try:
            request = msgspec.msgpack.decode(frames[0].bytes, type=_ReadRequest)
        except (IndexError, msgspec.DecodeError):
            return None
        try:
            index = torch.tensor(request.block_ids, dtype=torch.long)
            if request.write:
                self.kv_cache.tensor.index_copy_(2, index, self._frame_tensor(
                    frames[1], len(request.block_ids)))
                return [msgspec.msgpack.encode(_ReadReply(request.seq, True))]
            gathered = self.kv_cache.tensor.index_select(2, index)
            return [msgspec.msgpack.encode(_ReadReply(request.seq, True)),
                    gathered.view(torch.uint8).numpy()]
        except (IndexError, RuntimeError, ValueError) as exc:
            return [msgspec.msgpack.encode(_ReadReply(request.seq, False, str(exc)))]

    def _frame_tensor(self, frame, num_blocks: int) -> torch.Tensor:
        """A received frame viewed as [layers, 2, num_blocks, block_size, KVH, D] (no copy)."""
        layout = self.kv_cache.layout
        shape = (*layout.shape[:2], num_blocks, *layout.shape[3:])
        data = torch.frombuffer(frame.buffer, dtype=torch.uint8)
        return data.view(self.kv_cache.tensor.dtype).view(shape)

    # -- client side (job thread) --------------------------------------------------------------
    def _client(self, endpoint: str) -> zmq.Socket:
        sock = self._clients.get(endpoint)
        if sock is None:
            sock = self._clients[endpoint] = self._dealer(endpoint)
        return sock

    def _drop_client(self, endpoint: str) -> None:
        sock = self._clients.pop(endpoint, None)
        if sock is not None:
            sock.close(0)

    def _ask(self, sock: zmq.Socket, block_ids: list[int], write: bool = False,
             frames: tuple = ()) -> int:
        """Send one request; returns its sequence number."""
        self._seq += 1
        header = _ReadRequest(self._seq, block_ids, write)
        sock.send_multipart([msgspec.msgpack.encode(header), *frames], copy=False)
        return self._seq

    def _reply(self, sock: zmq.Socket, job: TransferJob, seq: int) -> list:
        reply_frames = self._await_reply(sock, job, seq)
        reply = msgspec.msgpack.decode(reply_frames[0].bytes, type=_ReadReply)
        if not reply.ok:
            raise TransferError(f"peer refused the transfer: {reply.error}")
        return reply_frames

    def _read(self, job: TransferJob) -> int:
        if not job.endpoint.startswith(PREFIX):
            raise ValueError(f"not a TCP endpoint: {job.endpoint}")
        sock = self._client(job.endpoint)
        step = max(1, PIECE_BYTES // self.kv_cache.layout.bytes_per_block)
        remote, local = job.remote_block_ids, job.local_block_ids
        asked: deque[tuple[int, list[int]]] = deque()  # (sequence number, local block ids)
        num_bytes = 0
        for first in range(0, len(remote), step):
            asked.append((self._ask(sock, remote[first:first + step]), local[first:first + step]))
            if len(asked) == IN_FLIGHT:
                num_bytes += self._store(sock, job, *asked.popleft())
        while asked:
            num_bytes += self._store(sock, job, *asked.popleft())
        return num_bytes

    def _store(self, sock: zmq.Socket, job: TransferJob, seq: int,
               local_block_ids: list[int]) -> int:
        """Wait for the reply to request `seq` and copy its blocks into ours; returns the
        bytes."""
        frames = self._reply(sock, job, seq)
        data = self._frame_tensor(frames[1], len(local_block_ids))
        index = torch.tensor(local_block_ids, dtype=torch.long)
        self.kv_cache.tensor.index_copy_(2, index, data)
        return data.numel() * data.element_size()

    def _write(self, job: TransferJob) -> int:
        if not job.endpoint.startswith(PREFIX):
            raise ValueError(f"not a TCP endpoint: {job.endpoint}")
        index = torch.tensor(job.local_block_ids, dtype=torch.long)
        gathered = self.kv_cache.tensor.index_select(2, index)
        sock = self._client(job.endpoint)
        self._reply(sock, job, self._ask(sock, job.remote_block_ids, True,
                                         (gathered.view(torch.uint8).numpy(),)))
        return gathered.numel() * gathered.element_size()

    def _await_reply(self, sock: zmq.Socket, job: TransferJob, seq: int) -> list:
        """The reply to request `seq` (a reply to an earlier request, one a timed-out transfer
        left behind, is dropped); waits in short slices so a cancelled job (its request was
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
            if msgspec.msgpack.decode(frames[0].bytes, type=_ReadReply).seq == seq:
                return frames

    def close(self) -> None:
        super().close()
        for endpoint in list(self._clients):
            self._drop_client(endpoint)
