"""The physical KV cache: one preallocated tensor, and export/import of blocks by id.

Layout: [num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]. One layer's
keys, `tensor[l, 0]`, is the [num_blocks, block_size, KVH, D] array that flash-attn's paged kernels
take. Block bookkeeping (who owns which block) is `common.block_pool`'s job, not this module's.

With `shared_memory`, the tensor lives in an unlinked file under /dev/shm that a peer process on
the same host maps through /proc (the shm transfer backend) and copies blocks from directly.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVLayout:
    """Shape of a KV cache; two caches with equal layouts can exchange blocks byte for byte."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        element = torch.finfo(DTYPE_BY_NAME[self.dtype]).bits // 8
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def with_num_blocks(self, num_blocks: int) -> KVLayout:
        return KVLayout(self.num_layers, num_blocks, self.block_size, self.num_kv_heads,
                        self.head_dim, self.dtype)


def _allocate_shared(layout: KVLayout, shm_dir: Path) -> tuple[torch.Tensor, int]:
    """Map a fresh file under `shm_dir` and unlink it at once, keeping an open descriptor.

    Peers on this host map it through /proc/<pid>/fd/<fd>; since no name is left in the file
    system, the memory goes back to the OS when this process ends, even by kill -9.
    """
    path = shm_dir / f"splitserve-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    numel = 1
    for dim in layout.shape:
        numel *= dim
    tensor = torch.from_file(str(path), shared=True, size=numel,
                             dtype=DTYPE_BY_NAME[layout.dtype])
    fd = os.open(path, os.O_RDONLY)
    path.unlink()
    return tensor.view(layout.shape), fd


def map_shared(share_path: str, layout: KVLayout) -> torch.Tensor:
    """Map a peer's shared KV cache (its `share_path`) read-only in spirit, with its layout."""
    size = os.path.getsize(share_path)
    element = torch.finfo(DTYPE_BY_NAME[layout.dtype]).bits // 8
    num_blocks = size // (layout.bytes_per_block)
    peer = layout.with_num_blocks(num_blocks)
    tensor = torch.from_file(share_path, shared=True, size=size // element,
                             dtype=DTYPE_BY_NAME[layout.dtype])
    return tensor.view(peer.shape)


class KVCache:
    def __init__(self, layout: KVLayout, device: str = "cpu", shared_memory: bool = False,
                 shm_dir: str = "/dev/shm") -> None:
        self.layout = layout
        self.device = torch.device(device)
        self._shm_fd: int | None = None
        if shared_memory:
            if self.device.type != "cpu":
                raise ValueError("a shared-memory KV cache must live on the CPU")
            self.tensor, self._shm_fd = _allocate_shared(layout, Path(shm_dir))
        else:
            self.tensor = torch.zeros(layout.shape, dtype=DTYPE_BY_NAME[layout.dtype],
                                      device=self.device)

    @property
    def share_path(self) -> str | None:
        """Where a same-host peer can map this cache, or None if it is not shared."""
        if self._shm_fd is None:
            return None
        return f"/proc/{os.getpid()}/fd/{self._shm_fd}"

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of one layer, each [num_blocks, block_size, KVH, D]."""
        return self.tensor[layer_idx, 0], self.tensor[layer_idx, 1]

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of the blocks: [num_layers, 2, len(block_ids), block_size, KVH, D]."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return self.tensor.index_select(2, index)

    def import_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write `data` (as returned by `export_blocks` of an equal layout) into `block_ids`."""
        expected = (*self.layout.shape[:2], len(block_ids), *self.layout.shape[3:])
        if tuple(data.shape) != expected:
            raise ValueError(f"KV data of shape {tuple(data.shape)} does not fit {expected}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.tensor.index_copy_(2, index, data.to(self.tensor.device, self.tensor.dtype))

    def close(self) -> None:
        if self._shm_fd is not None:
            os.close(self._shm_fd)
            self._shm_fd = None
