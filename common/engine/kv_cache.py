"""The physical KV cache: one preallocated tensor, and export/import of blocks by id.

Layout: [num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]. One layer's
keys, `tensor[l, 0]`, is the [num_blocks, block_size, KVH, D] array that flash-attn's paged kernels
take. Block bookkeeping (who owns which block) is `common.block_pool`'s job, not this module's.

With `shared_memory`, the tensor lives in a file under /dev/shm so a peer process on the same host
can map it and copy blocks without a socket (the shm transfer backend).
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

    def with_num_blocks(self, num_blocks: int) -> "KVLayout":
        return KVLayout(self.num_layers, num_blocks, self.block_size, self.num_kv_heads,
                        self.head_dim, self.dtype)


def _allocate_shared(layout: KVLayout, shm_dir: Path) -> tuple[torch.Tensor, Path]:
    path = shm_dir / f"splitserve-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    numel = 1
    for dim in layout.shape:
        numel *= dim
    tensor = torch.from_file(str(path), shared=True, size=numel,
                             dtype=DTYPE_BY_NAME[layout.dtype])
    return tensor.view(layout.shape), path


class KVCache:
    def __init__(self, layout: KVLayout, device: str = "cpu", shared_memory: bool = False,
                 shm_dir: str = "/dev/shm") -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.shm_path: Path | None = None
        if shared_memory:
            if self.device.type != "cpu":
                raise ValueError("a shared-memory KV cache must live on the CPU")
            self.tensor, self.shm_path = _allocate_shared(layout, Path(shm_dir))
        else:
            self.tensor = torch.zeros(layout.shape, dtype=DTYPE_BY_NAME[layout.dtype],
                                      device=self.device)

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
        """Release the shared-memory file (the mapping itself goes with the tensor)."""
        if self.shm_path is not None:
            self.shm_path.unlink(missing_ok=True)
            self.shm_path = None
