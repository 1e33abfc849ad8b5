"""Same-host GPU transfer with CUDA IPC: map the peer's whole KV cache and copy device to device.

This module owns the "cuda_ipc" backend, for instances whose KV caches live on GPUs of one host
(NVLink or PCIe peer-to-peer; the driver picks the path).

Serving side: exports a CUDA IPC handle for its whole cache tensor with
`torch.multiprocessing.reductions.reduce_tensor`, the call torch's own multiprocessing pickler
makes, and hands it out from a small ZeroMQ ROUTER service; the endpoint is
"cuda_ipc://tcp://host:port". The handle travels as plain msgpack fields, never pickled, so a
peer cannot make this process run code. Reading side: asks each peer once, opens the handle
(`rebuild_cuda_tensor`), then each job is `copy_blocks` between two CUDA tensors and a
synchronize before the result is reported, so "done" means the bytes are in our blocks.

Mapped memory outlives nothing: once the exporting process exits, its allocation is gone, and
reading the mapping is undefined. So every job checks that the peer's pid is alive before and
after the copy (which needs one pid namespace: checked when the handle is opened).

Cross-host GPUs would use NCCL send/recv (or UCX built with CUDA) instead: not implemented here.
"""

from __future__ import annotations

import os
import socket
import time

import msgspec
import torch

from kv_transfer.base import ServedBackend, TransferError, TransferJob, copy_blocks

PREFIX = "cuda_ipc://"


class CudaIpcUnavailable(RuntimeError):
    """No CUDA device or no CUDA KV cache; the message is one line for the start-up log."""


class _Handle(msgspec.Struct):
    """What rebuild_cuda_tensor needs, plus what tells whether the mapping is still usable."""

    hostname: str
    pid: int
    pid_namespace: int
    device_uuid: str
    dtype: str
    shape: list[int]
    stride: list[int]
    tensor_offset: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_index(uuid: str) -> int:
    """This process's index for the device with `uuid` (CUDA_VISIBLE_DEVICES may renumber)."""
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == uuid:
            return index
    raise TransferError(f"the peer's GPU {uuid} is not visible to this process")


def _alive(pid: int) -> bool:
    """Whether the process runs. A zombie does not: its GPU memory went back at exit, though
    kill(pid, 0) would still succeed until its parent reaps it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")


class CudaIpcBackend(ServedBackend):
    name = "cuda_ipc"
    endpoint_prefix = PREFIX

    def __init__(self, kv_cache, host, config) -> None:
        if not torch.cuda.is_available():
            raise CudaIpcUnavailable("the cuda_ipc backend needs CUDA (torch.cuda.is_available() "
                                     f"is False; torch {torch.__version__})")
        if kv_cache.device.type != "cuda":
            raise CudaIpcUnavailable("the cuda_ipc backend needs the KV cache on a CUDA device "
                                     f"(it is on {kv_cache.device})")
        super().__init__(kv_cache, host, config)  # the handle service: CurveZMQ, as on tcp
        self._peers: dict[str, tuple[torch.Tensor, int]] = {}  # endpoint -> (mapped cache, pid)

    # -- serving side ------------------------------------------------------------------------------
    def _answer(self, frames: list) -> list:
        try:
            return [b"ok", msgspec.msgpack.encode(self._export())]
        except RuntimeError as exc:  # a CUDA error: say so rather than let the peer time out
            return [b"error", str(exc).encode()]

    def _export(self) -> _Handle:
        """A fresh handle per asking peer: reduce_tensor gives each its own reference count,
        which the peer's mapping releases when it is dropped."""
        from torch.multiprocessing.reductions import reduce_tensor

        tensor = self.kv_cache.tensor
        _, args = reduce_tensor(tensor)
        (_cls, _size, _stride, offset, _storage_cls, _dtype, device, handle, size_bytes,
         offset_bytes, _grad, ref_handle, ref_offset, event_handle, event_sync) = args
        return _Handle(socket.gethostname(), os.getpid(), _pid_namespace(), _device_uuid(device),
                       str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
                       list(tensor.stride()), offset, handle, size_bytes, offset_bytes,
                       ref_handle, ref_offset, event_handle, event_sync)

    # -- reading side (job thread) -----------------------------------------------------------------
    def _fetch_handle(self, endpoint: str, deadline: float) -> _Handle:
        sock = self._dealer(endpoint.removeprefix(PREFIX))
        try:
            sock.send(b"handle")
            if not sock.poll(int(max(deadline - time.monotonic(), 0) * 1000)):
                raise TimeoutError(f"no CUDA IPC handle from {endpoint} before the deadline")
            status, payload = sock.recv_multipart()
            if status != b"ok":
                raise TransferError(f"the peer could not export its cache: {payload.decode()}")
            return msgspec.msgpack.decode(payload, type=_Handle)
        finally:
            sock.close(0)

    def _open(self, handle: _Handle) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if (handle.hostname, handle.pid_namespace) != (socket.gethostname(), _pid_namespace()):
            raise TransferError("cuda_ipc peers must share one host and one pid namespace "
                                f"(peer: {handle.hostname}, here: {socket.gethostname()})")
        local = self.kv_cache.tensor
        if (handle.dtype != str(local.dtype).removeprefix("torch.")
                or handle.shape[:2] + handle.shape[3:] != list(local.shape[:2] + local.shape[3:])):
            raise TransferError(f"peer cache {handle.shape} {handle.dtype} has another block "
                                f"layout than ours {list(local.shape)} {local.dtype}")
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(handle.shape), tuple(handle.stride), handle.tensor_offset,
            torch.storage.TypedStorage, getattr(torch, handle.dtype),
            _local_index(handle.device_uuid), handle.storage_handle, handle.storage_size_bytes,
            handle.storage_offset_bytes, False, handle.ref_counter_handle,
            handle.ref_counter_offset, handle.event_handle, handle.event_sync_required)

    def _remote(self, job: TransferJob) -> tuple[torch.Tensor, int]:
        if not job.endpoint.startswith(PREFIX):
            raise ValueError(f"not a CUDA IPC endpoint: {job.endpoint}")
        peer = self._peers.get(job.endpoint)
        if peer is None:
            handle = self._fetch_handle(job.endpoint, job.deadline)
            peer = self._peers[job.endpoint] = (self._open(handle), handle.pid)
        if not _alive(peer[1]):
            self._peers.pop(job.endpoint, None)  # drop the mapping of a peer that is gone
            raise ConnectionError("the peer instance has exited")
        return peer

    def _copy(self, job: TransferJob, src, src_ids, dst, dst_ids, pid: int) -> int:
        with torch.cuda.device(self.kv_cache.device):
            copy_blocks(src, src_ids, dst, dst_ids)
            # Copies are asynchronous: wait on both devices before reporting the job done.
            torch.cuda.synchronize(dst.device)
            if src.device != dst.device:
                torch.cuda.synchronize(src.device)
        if not _alive(pid):  # it may have died during the copy: the bytes are not trustworthy
            self._peers.pop(job.endpoint, None)
            raise ConnectionError("the peer instance exited during the copy")
        return len(job.local_block_ids) * self.kv_cache.layout.bytes_per_block

    def _read(self, job: TransferJob) -> int:
        remote, pid = self._remote(job)
        return self._copy(job, remote, job.remote_block_ids, self.kv_cache.tensor,
                          job.local_block_ids, pid)

    def _write(self, job: TransferJob) -> int:
        remote, pid = self._remote(job)
        return self._copy(job, self.kv_cache.tensor, job.local_block_ids, remote,
                          job.remote_block_ids, pid)

    def close(self) -> None:
        super().close()
        self._peers.clear()  # releases the mappings and the peers' reference counts
