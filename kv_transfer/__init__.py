"""KV cache transfer between instances (DESIGN.md §6): backends behind one interface.

`make_backend(name, kv_cache, host, config)` builds the backend registered under `name`. The
same names are published in the `splitserve.kv_backends` entry-point group, through which the
instance worker (in `common`, which may not import this package) finds them.
"""

from __future__ import annotations

from common.registry import Registry
from kv_transfer.base import KVTransferBackend, ReadJob, TransferJob, TransferResult
from kv_transfer.cuda_ipc import CudaIpcBackend  # imports torch only; CUDA is checked when built
from kv_transfer.shm import SharedMemoryBackend
from kv_transfer.tcp import TcpBackend
from kv_transfer.ucx import UcxBackend  # ucx-py/ucxx are imported when the backend is built

BACKENDS: Registry[type[KVTransferBackend]] = Registry("KV transfer backend")
BACKENDS.register("tcp")(TcpBackend)
BACKENDS.register("shm")(SharedMemoryBackend)
BACKENDS.register("ucx")(UcxBackend)
BACKENDS.register("cuda_ipc")(CudaIpcBackend)

__all__ = ["BACKENDS", "KVTransferBackend", "ReadJob", "TransferJob", "TransferResult",
           "make_backend"]


def make_backend(name: str, kv_cache, host: str, config) -> KVTransferBackend:
    return BACKENDS.get(name)(kv_cache, host, config)
