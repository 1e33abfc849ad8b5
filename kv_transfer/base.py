"""The KV transfer interface both roles use: serve local blocks, read a peer's blocks.

Transfers are pull-based, like an RDMA READ: the instance that will decode a sequence allocates
its own blocks first, then reads the prefill instance's blocks into them, then tells the prefill
instance (KVTransferDone) that it may free its copy. The prefill instance holds the blocks under
a lease until then.

    decode role                       backend worker thread             prefill instance
    -----------                       ---------------------             ----------------
    allocate local blocks
    submit(ReadJob) ----------------> copy remote blocks -> local  <--- serves its blocks
    poll() -> TransferResult <------- (ok / failed, bytes, seconds)
    KVTransferDone --------------------------------------------------> free its blocks

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

from common.config import TransferConfig
from common.engine.kv_cache import KVCache


@dataclass(frozen=True)
class ReadJob:
    request_id: str
    endpoint: str  # the peer's kv_endpoint
    remote_block_ids: list[int]
    local_block_ids: list[int]
    deadline: float  # time.monotonic() after which the job fails


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    ok: bool
    error: str = ""
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
    """One instance's end of KV movement. Reads run on one worker thread, in order."""

    name = "?"
    needs_shared_cache = False  # peers read this instance's cache in place (shared memory)

    def __init__(self, kv_cache: KVCache, host: str, config: TransferConfig) -> None:
        self.kv_cache = kv_cache
        self.host = host
        self.config = config
        self._jobs: queue.Queue[ReadJob | None] = queue.Queue()
        self._results: queue.Queue[TransferResult] = queue.Queue()
        self._cancelled: set[str] = set()
        self._worker = threading.Thread(target=self._work, name=f"kv-{self.name}", daemon=True)

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """How peers reach this instance's blocks."""

    @abstractmethod
    def _read(self, job: ReadJob) -> int:
        """Copy the job's remote blocks into the local ones; return bytes moved or raise."""

    def start(self) -> None:
        self._worker.start()

    def submit(self, job: ReadJob) -> None:
        self._jobs.put(job)

    def cancel(self, request_id: str) -> None:
        """Skip the job if it has not started; its result is still reported (as failed)."""
        self._cancelled.add(request_id)

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
            self._results.put(self._run(job))

    def _run(self, job: ReadJob) -> TransferResult:
        if job.request_id in self._cancelled:
            self._cancelled.discard(job.request_id)
            return TransferResult(job.request_id, False, "cancelled")
        if time.monotonic() > job.deadline:
            return TransferResult(job.request_id, False, "deadline passed before the read")
        started = time.perf_counter()
        try:
            num_bytes = self._read(job)
        except Exception as exc:  # any failure of the peer or the link fails this job only
            return TransferResult(job.request_id, False, f"{type(exc).__name__}: {exc}")
        return TransferResult(job.request_id, True, "", num_bytes, time.perf_counter() - started)

    def close(self) -> None:
        self._jobs.put(None)
        if self._worker.is_alive():
            self._worker.join(timeout=5)
