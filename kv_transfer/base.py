"""What the backends share: the job thread, emulated pacing, and the ZeroMQ server thread.

The contract (interface, jobs, results, status) is `common.transfer`; this module implements
it once for every backend here. `ThreadedBackend` runs jobs in submission order on one thread,
like one NIC queue. With emulation on, each job also waits until its emulated duration
(latency + bytes / bandwidth) has passed, so a small model on one host reproduces the transfer
regime of a big model on a real network. `ServedBackend` adds a ROUTER socket answered on a
thread of its own, for backends whose peers ask this instance for something (tcp: the blocks;
cuda_ipc: a handle to the cache).
"""

from __future__ import annotations

import queue
import threading
import time
from abc import abstractmethod
from typing import ClassVar

import torch
import zmq

from common.config import EmulationConfig, TransferConfig
from common.engine.kv_cache import KVCache
from common.messaging import advertised, bind_address
from common.security import guard_context, load_keys
from common.transfer import (
    KVTransferBackend,
    TransferError,
    TransferJob,
    TransferResult,
    TransferStats,
    TransferStatus,
)

_POLL_MS = 100  # how often a server thread looks at its stop flag


def copy_blocks(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor,
                dst_ids: list[int]) -> None:
    """dst[:, :, dst_ids] = src[:, :, src_ids], one strided copy per run of consecutive ids."""
    start = 0
    for i in range(1, len(src_ids) + 1):
        if (i == len(src_ids) or src_ids[i] != src_ids[i - 1] + 1
                or dst_ids[i] != dst_ids[i - 1] + 1):
            count = i - start
            dst[:, :, dst_ids[start]:dst_ids[start] + count].copy_(
                src[:, :, src_ids[start]:src_ids[start] + count])
            start = i


def _result(job: TransferJob, status: TransferStatus, error: str = "", num_bytes: int = 0,
            seconds: float = 0.0) -> TransferResult:
    return TransferResult(job.request_id, status, error, num_bytes, seconds, job.final)


class ThreadedBackend(KVTransferBackend):
    """Jobs run on one thread, in order; subclasses say how one job's bytes move."""

    def __init__(self, kv_cache: KVCache, host: str, config: TransferConfig) -> None:
        self.kv_cache = kv_cache
        self.host = host
        self.config = config
        self.emulation: EmulationConfig = config.emulation  # replaceable while running
        self.stats = TransferStats()
        self.on_result = None
        self._jobs: queue.Queue[TransferJob | None] = queue.Queue()
        self._results: queue.Queue[TransferResult] = queue.Queue()
        self._cancelled: set[str] = set()
        self._job_thread = threading.Thread(target=self._work, name=f"kv-{self.name}", daemon=True)

    @abstractmethod
    def _read(self, job: TransferJob) -> int:
        """Copy the job's remote blocks into the local ones; return bytes moved or raise."""

    def _write(self, job: TransferJob) -> int:
        """Copy the job's local blocks into the remote ones; return bytes moved or raise."""
        raise TransferError(f"the {self.name} backend does not write into peers")

    def start(self) -> None:
        self._job_thread.start()

    def submit(self, job: TransferJob) -> None:
        self._jobs.put(job)

    def cancel(self, request_id: str) -> None:
        self._cancelled.add(request_id)

    def forget(self, request_id: str) -> None:
        self._cancelled.discard(request_id)

    def cancelled(self, request_id: str) -> bool:
        return request_id in self._cancelled

    def poll(self) -> list[TransferResult]:
        results = []
        while True:
            try:
                results.append(self._results.get_nowait())
            except queue.Empty:
                return results

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            result = self._run(job)
            self._account(result)
            self._results.put(result)

    def _run(self, job: TransferJob) -> TransferResult:
        if job.request_id in self._cancelled:
            return _result(job, TransferStatus.ABORTED, "cancelled")
        if time.monotonic() > job.deadline:
            return _result(job, TransferStatus.FAILED, "deadline passed before the transfer")
        if self.config.fault == "stall":
            return self._stall(job)
        started = time.perf_counter()
        try:
            num_bytes = self._write(job) if job.write else self._read(job)
        except Exception as exc:  # any failure of the peer or the link fails this job only
            return _result(job, TransferStatus.FAILED, f"{type(exc).__name__}: {exc}")
        self._pace(started, num_bytes, job)
        return _result(job, TransferStatus.DONE, "", num_bytes, time.perf_counter() - started)

    def _stall(self, job: TransferJob) -> TransferResult:
        """Injected fault: the transfer never completes; it fails at its deadline (or when
        cancelled), as a hung peer or link would make it."""
        while time.monotonic() < job.deadline and job.request_id not in self._cancelled:
            time.sleep(0.05)
        return _result(job, TransferStatus.FAILED, "transfer stalled (injected fault)")

    def _pace(self, started: float, num_bytes: int, job: TransferJob) -> None:
        emulated = self.emulation.duration(num_bytes, job.num_tokens)
        remaining = min(emulated - (time.perf_counter() - started),
                        job.deadline - time.monotonic())
        if remaining > 0:
            time.sleep(remaining)

    def _account(self, result: TransferResult) -> None:
        if self.on_result is not None:
            self.on_result(result)
        self.stats.num_transfers += 1
        if result.ok:
            self.stats.num_bytes += result.num_bytes
            self.stats.seconds += result.seconds
        else:
            self.stats.num_failures += 1

    def close(self) -> None:
        self._jobs.put(None)
        if self._job_thread.is_alive():
            self._job_thread.join(timeout=5)


class ServedBackend(ThreadedBackend):
    """A ThreadedBackend that also answers peers: a ZeroMQ ROUTER (CurveZMQ with a cluster
    secret) served on its own thread, and DEALER sockets to reach the peers' servers."""

    endpoint_prefix: ClassVar[str] = ""  # before the ROUTER's tcp:// address in `endpoint`

    def __init__(self, kv_cache: KVCache, host: str, config: TransferConfig) -> None:
        super().__init__(kv_cache, host, config)
        self._ctx = zmq.Context.instance()
        self._keys = load_keys(config.cluster_secret_file)
        self._server = self._ctx.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            guard_context(self._ctx, self._keys)
            self._keys.serve(self._server)
        self._server.bind(bind_address(host, config.port))
        self._endpoint = self.endpoint_prefix + advertised(
            self._server.getsockopt_string(zmq.LAST_ENDPOINT), config.advertise_host)
        self._stop = threading.Event()
        self._server_thread = threading.Thread(target=self._serve, name=f"kv-{self.name}-server",
                                               daemon=True)

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @abstractmethod
    def _answer(self, frames: list[zmq.Frame]) -> list | None:
        """The reply frames to one peer request (its frames after the identity); None: no
        reply (the request was not understood)."""

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._server.poll(_POLL_MS):
                continue
            identity, *frames = self._server.recv_multipart(copy=False)
            reply = self._answer(frames)
            if reply is not None:
                self._server.send_multipart([identity.bytes, *reply], copy=False)
        self._server.close(0)

    def _dealer(self, address: str) -> zmq.Socket:
        """A socket connected to a peer's server (the caller closes it)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            self._keys.connect(sock)
        try:
            sock.connect(address)
        except zmq.ZMQError:
            sock.close(0)
            raise
        return sock

    def start(self) -> None:
        self._server_thread.start()
        super().start()

    def close(self) -> None:
        self._stop.set()
        super().close()
        if self._server_thread.is_alive():
            self._server_thread.join(timeout=2)
