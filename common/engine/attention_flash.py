"""Attention on CUDA with flash-attn's varlen kernel over the paged KV cache.

One call per layer covers the whole flat batch (decode tokens and prefill chunks together):
`cu_seqlens_q` delimits each sequence's query rows, `cu_seqlens_k` its context length, and
`block_table` maps its context to cache blocks. flash-attn aligns the causal mask to the end of
the context, which is what a chunk of a partly cached prompt needs. flash-attn 2's paged path
requires blocks of a multiple of 256 tokens.
"""

from __future__ import annotations

import torch

from common.engine.attention import Segment, refuse_features, slot_mapping
from common.engine.kv_cache import KVCache


def available(block_size: int) -> bool:
    if block_size % 256 != 0:
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class FlashAttention:
    def __init__(self, segments: list[Segment], kv_cache: KVCache, ops) -> None:
        device = kv_cache.device
        self.kv_cache = kv_cache
        self.ops = ops
        block_size = kv_cache.layout.block_size
        stored = [s for s in segments if s.store]  # padding rows are computed, not attended
        self.num_stored = sum(s.num_tokens for s in stored)
        self.slots = torch.tensor(slot_mapping(segments, block_size), dtype=torch.long,
                                  device=device)
        as_int32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)
        self.cu_q = as_int32([0] + _cumsum([s.num_tokens for s in stored]))
        self.cu_k = as_int32([0] + _cumsum([s.num_context for s in stored]))
        self.max_q = max((s.num_tokens for s in stored), default=0)
        self.max_k = max((s.num_context for s in stored), default=0)
        max_blocks = max((-(-s.num_context // block_size) for s in stored), default=0)
        self.block_table = as_int32([s.block_ids[:max_blocks] + [0] * (max_blocks - len(
            s.block_ids[:max_blocks])) for s in stored])

    def __call__(self, layer_idx, q, k, v, scale=None, **features):
        # flash-attn 2.6+ has window_size and softcap, but this path is not tested on a GPU
        # with them: refused, and the runner picks TorchAttention for models that need them.
        refuse_features("the flash-attn backend", features)
        from flash_attn import flash_attn_varlen_func

        k_cache, v_cache = self.kv_cache.layer(layer_idx)
        self.ops.store_kv(k_cache, v_cache, self.slots, k[: self.num_stored],
                          v[: self.num_stored])
        out = torch.zeros_like(q)
        out[: self.num_stored] = flash_attn_varlen_func(
            q[: self.num_stored].contiguous(), k_cache, v_cache, self.cu_q, self.cu_k,
            self.max_q, self.max_k, softmax_scale=scale, causal=True,
            block_table=self.block_table)
        return out


def _cumsum(values: list[int]) -> list[int]:
    total, out = 0, []
    for value in values:
        total += value
        out.append(total)
    return out
