"""The KV transfer interface both roles use: one-sided reads and writes of block ranges.

Metadata (which blocks, how many tokens, the first token, leases) travels in the protocol's
messages (KVTransferOffer, KVChunkReady, KVTransferDone); the block bytes move through a backend.
The roles use reads, like an RDMA READ: the instance that will decode a sequence allocates its
own blocks, reads the prefill instance's blocks into them, then tells the prefill instance that
it may free its copy. Writes (push local blocks into a peer's) are the mirror operation.

    decode role                       backend worker thread             prefill instance
    -----------                       ---------------------             ----------------
    allocate local blocks
    submit(TransferJob) ------------> copy remote blocks -> local  <--- serves its blocks
    poll() -> TransferResult <------- (ok / failed, bytes, seconds)
    KVTransferDone --------------------------------------------------> free its blocks

With chunk-level granularity one job per chunk runs as the chunk's KV appears. Jobs run in
submission order on one worker thread: one link, like one NIC queue. With emulation on, each job
also waits until its emulated duration (latency + bytes / bandwidth) has passed, so a small
model on one host reproduces the transfer regime of a big model on a real network.

Contract: the caller frees or reuses the local blocks of a job only after `poll()` returned that
job's result (a cancelled job still reports one), so the worker never writes into blocks that
belong to someone else.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from common.config import EmulationConfig, TransferConfig
from common.engine.kv_cache import KVCache


@dataclass(frozen=True)
class TransferJob:
    request_id: str
    endpoint: str  # the peer's kv_endpoint
    remote_block_ids: list[int]
    local_block_ids: list[int]
    deadline: float  # time.monotonic() after which the job fails
    num_tokens: int = 0  # tokens whose KV this job moves (for emulated byte counts)
    write: bool = False  # push local blocks into the peer's instead of reading them
    final: bool = True  # the last job of this request's hand-off (chunk-level has several)


ReadJob = TransferJob  # the common case reads the peer's blocks


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    ok: bool
    error: str = ""
    num_bytes: int = 0
    seconds: float = 0.0
    final: bool = True


@dataclass
class TransferStats:
    """Totals since start, for load reports and /metrics."""

    num_transfers: int = 0
    num_failures: int = 0
    num_bytes: int = 0
    seconds: float = 0.0


class TransferError(RuntimeError):
    pass


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


class KVTransferBackend(ABC):
    """One instance's end of KV movement. Jobs run on one worker thread, in order."""

    name = "?"
    needs_shared_cache = False  # peers read this instance's cache in place (shared memory)

    def __init__(self, kv_cache: KVCache, host: str, config: TransferConfig) -> None:
        self.kv_cache = kv_cache
        self.host = host
        self.config = config
        self.emulation: EmulationConfig = config.emulation  # replaceable while running
        self.stats = TransferStats()
        self.on_result = None  # optional callable(TransferResult), called on the worker thread
        self._jobs: queue.Queue[TransferJob | None] = queue.Queue()
        self._results: queue.Queue[TransferResult] = queue.Queue()
        self._cancelled: set[str] = set()
        self._worker = threading.Thread(target=self._work, name=f"kv-{self.name}", daemon=True)

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """How peers reach this instance's blocks."""

    @abstractmethod
    def _read(self, job: TransferJob) -> int:
        """Copy the job's remote blocks into the local ones; return bytes moved or raise."""

    def _write(self, job: TransferJob) -> int:
        """Copy the job's local blocks into the remote ones; return bytes moved or raise."""
        raise TransferError(f"the {self.name} backend does not write into peers")

    def start(self) -> None:
        self._worker.start()

    def submit(self, job: TransferJob) -> None:
        self._jobs.put(job)

    def cancel(self, request_id: str) -> None:
        """Skip the request's jobs that have not started; their results still come back."""
        self._cancelled.add(request_id)

    def forget(self, request_id: str) -> None:
        """The request's last result has been taken: stop remembering it was cancelled."""
        self._cancelled.discard(request_id)

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
            return TransferResult(job.request_id, False, "cancelled", final=job.final)
        if time.monotonic() > job.deadline:
            return TransferResult(job.request_id, False, "deadline passed before the transfer",
                                  final=job.final)
        if self.config.fault == "stall":
            return self._stall(job)
        started = time.perf_counter()
        try:
            num_bytes = self._write(job) if job.write else self._read(job)
        except Exception as exc:  # any failure of the peer or the link fails this job only
            return TransferResult(job.request_id, False, f"{type(exc).__name__}: {exc}",
                                  final=job.final)
        self._pace(started, num_bytes, job)
        return TransferResult(job.request_id, True, "", num_bytes,
                              time.perf_counter() - started, job.final)

    def _stall(self, job: TransferJob) -> TransferResult:
        """Injected fault: the transfer never completes; it fails at its deadline (or when
        cancelled), as a hung peer or link would make it."""
        while time.monotonic() < job.deadline and job.request_id not in self._cancelled:
            time.sleep(0.05)
        return TransferResult(job.request_id, False, "transfer stalled (injected fault)",
                              final=job.final)

    def cancelled(self, request_id: str) -> bool:
        return request_id in self._cancelled

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
        if self._worker.is_alive():
            self._worker.join(timeout=5)
