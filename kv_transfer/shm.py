"""Same-host transfer through shared memory: map the peer's KV cache and copy blocks directly.

The peer's cache lives in an unlinked /dev/shm file reachable as /proc/<pid>/fd/<fd> (see
common.engine.kv_cache). A read is one strided memcpy per run of consecutive blocks, with no
socket and no intermediate buffer.
"""

from __future__ import annotations

import os

from common.engine.kv_cache import map_shared
from kv_transfer.base import KVTransferBackend, TransferJob, copy_blocks

PREFIX = "shm://"


class SharedMemoryBackend(KVTransferBackend):
    name = "shm"
    needs_shared_cache = True

    def __init__(self, kv_cache, host, config) -> None:
        if kv_cache.share_path is None:
            raise ValueError("the shm backend needs a KV cache allocated in shared memory")
        super().__init__(kv_cache, host, config)
        self._peers: dict[str, object] = {}

    @property
    def endpoint(self) -> str:
        return PREFIX + self.kv_cache.share_path

    def _peer(self, endpoint: str):
        tensor = self._peers.get(endpoint)
        if tensor is None:
            tensor = map_shared(endpoint.removeprefix(PREFIX), self.kv_cache.layout)
            self._peers[endpoint] = tensor
        return tensor

    def _remote(self, job: TransferJob):
        if not job.endpoint.startswith(PREFIX):
            raise ValueError(f"not a shared-memory endpoint: {job.endpoint}")
        if not os.path.exists(job.endpoint.removeprefix(PREFIX)):
            # The peer has exited: drop our mapping so its memory can go back to the OS.
            self._peers.pop(job.endpoint, None)
            raise ConnectionError("the peer instance has exited")
        try:
            return self._peer(job.endpoint)
        except (OSError, RuntimeError) as exc:
            self._peers.pop(job.endpoint, None)
            raise ConnectionError(f"peer's shared KV cache is gone: {exc}") from None

    def _read(self, job: TransferJob) -> int:
        copy_blocks(self._remote(job), job.remote_block_ids, self.kv_cache.tensor,
                    job.local_block_ids)
        return len(job.local_block_ids) * self.kv_cache.layout.bytes_per_block

    def _write(self, job: TransferJob) -> int:
        copy_blocks(self.kv_cache.tensor, job.local_block_ids, self._remote(job),
                    job.remote_block_ids)
        return len(job.local_block_ids) * self.kv_cache.layout.bytes_per_block
