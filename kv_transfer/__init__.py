"""KV cache transfer between instances (DESIGN.md §6): the backends behind `common.transfer`.

Each backend is one module here (tcp, shm, ucx, cuda_ipc) plus one line in pyproject.toml's
`splitserve.kv_backends` entry-point group, the only place backends are registered:
`make_backend(name, kv_cache, host, config)` builds the one registered under `name`. Importing
this package imports no backend (so never ucx-py, ucxx or CUDA).
"""

from __future__ import annotations

from common.transfer import (
    BACKENDS,
    KVTransferBackend,
    ReadJob,
    TransferJob,
    TransferResult,
    TransferStatus,
    make_backend,
)

__all__ = ["BACKENDS", "KVTransferBackend", "ReadJob", "TransferJob", "TransferResult",
           "TransferStatus", "make_backend"]
