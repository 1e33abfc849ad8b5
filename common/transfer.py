"""The KV transfer contract: the backend interface, job and result types, and transfer status.

This module owns what the roles and the instance worker know about moving KV blocks; the
backends themselves live in `kv_transfer/` (which imports this, never the other way round).
It imports no torch, so roles are typed against it without loading a backend.

Metadata (which blocks, how many tokens, the first token, leases) travels in the protocol's
messages (KVTransferOffer, KVChunkReady, KVTransferDone); the block bytes move through a backend.
The roles use reads, like an RDMA READ: the instance that will decode a sequence allocates its
own blocks, reads the prefill instance's blocks into them, then tells the prefill instance that
it may free its copy. Writes (push local blocks into a peer's) are the mirror operation.

    decode role                       backend's job thread              prefill instance
    -----------                       --------------------              ----------------
    allocate local blocks
    submit(TransferJob) ------------> copy remote blocks -> local  <--- serves its blocks
    poll() -> TransferResult <------- (status, bytes, seconds)
    KVTransferDone(status) ------------------------------------------> free or re-offer

With chunk-level granularity one job per chunk runs as the chunk's KV appears. Jobs run in
submission order on one thread: one link, like one NIC queue.

Contract: the caller frees or reuses the local blocks of a job only after `poll()` returned that
job's result (a cancelled job still reports one), so a backend never writes into blocks that
belong to someone else.

Backends are found by name in the `splitserve.kv_backends` entry-point group (pyproject.toml):
`make_backend("tcp", ...)`; an unknown name's error lists the installed ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar

from common.registry import Registry

if TYPE_CHECKING:
    from common.config import TransferConfig
    from common.engine.kv_cache import KVCache


class TransferStatus(StrEnum):
    """What became of a transfer job, or of a whole hand-off (KVTransferDone)."""

    DONE = "done"  # the blocks were copied
    REJECTED = "rejected"  # refused before any block was touched: offer them elsewhere
    FAILED = "failed"  # the peer, the link or a deadline failed it
    ABORTED = "aborted"  # cancelled: the request was aborted or its peer declared dead


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
    status: TransferStatus
    error: str = ""  # why, when not DONE
    num_bytes: int = 0
    seconds: float = 0.0
    final: bool = True

    @property
    def ok(self) -> bool:
        return self.status is TransferStatus.DONE


@dataclass
class TransferStats:
    """Totals since start, for load reports and /metrics."""

    num_transfers: int = 0
    num_failures: int = 0
    num_bytes: int = 0
    seconds: float = 0.0


class TransferError(RuntimeError):
    """A peer or link refused or broke a job; the job fails, the backend goes on."""


class KVTransferBackend(ABC):
    """One instance's end of KV movement, built as `cls(kv_cache, host, config)`.

    Jobs run in submission order on the backend's own thread; results come back through
    `poll()` (and, as they happen, through `on_result`, called on that thread)."""

    name: ClassVar[str] = "?"
    needs_shared_cache: ClassVar[bool] = False  # peers read this cache in place (shared memory)

    stats: TransferStats
    on_result: Callable[[TransferResult], None] | None

    @abstractmethod
    def __init__(self, kv_cache: KVCache, host: str, config: TransferConfig) -> None:
        """Bind what peers reach (the endpoint); no thread runs before `start()`."""

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """How peers reach this instance's blocks."""

    @abstractmethod
    def start(self) -> None:
        """Start the threads that run jobs and answer peers."""

    @abstractmethod
    def submit(self, job: TransferJob) -> None:
        """Queue a job; its result comes back through `poll()`."""

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """Skip (or stop waiting on) the request's jobs; their results still come back."""

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """The request's last result has been taken: stop remembering it was cancelled."""

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """The results finished since the last call, in order."""

    @abstractmethod
    def close(self) -> None:
        """Stop the threads and release the peers' mappings or sockets."""


BACKENDS: Registry[type[KVTransferBackend]] = Registry("KV transfer backend",
                                                       group="splitserve.kv_backends")


def make_backend(name: str, kv_cache: KVCache, host: str,
                 config: TransferConfig) -> KVTransferBackend:
    """The backend registered as `name`, built (not started)."""
    return BACKENDS.get(name)(kv_cache, host, config)
