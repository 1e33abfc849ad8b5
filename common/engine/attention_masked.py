"""Attention with what the fast kernels lack: sliding windows and attention-logit soft-capping.

`TorchAttention` sends a layer's call here when it asks for a soft-cap, or for a window shorter
than some context of the forward; every other layer of the same forward keeps the fast paths
(the C++ decode/prefill/varlen kernels, torch SDPA). One sequence at a time:

- only the cache blocks the window can reach are gathered (a long context costs what its
  window costs);
- with a soft-cap, scores are computed as transformers' eager attention does: q k^T * scale,
  then softcap * tanh(scores / softcap), then the causal/window mask, softmax in float32;
- without one (a window alone), torch SDPA with a boolean mask.

Written for correctness first: decodes are not batched across sequences here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Rows of whole blocks: [len(blocks) * block_size, KVH, D] (one memcpy per block)."""
    num_blocks, _, num_kv_heads, head_dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, blocks)
    return rows.view(-1, num_kv_heads, head_dim)


def visible_keys(query_start: int, num_queries: int, key_start: int, num_keys: int,
                 window: int | None, device) -> torch.Tensor:
    """[num_queries, num_keys] bool: causal, and within `window` tokens of the query."""
    query_pos = torch.arange(query_start, query_start + num_queries, device=device)[:, None]
    key_pos = torch.arange(key_start, key_start + num_keys, device=device)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    return visible


def softcapped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         visible: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """q: [n, H, D]; keys, values: [L, KVH, D]; visible: [n, L]. Returns [n, H, D]."""
    num_queries, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    # Query heads of one KV group act as that group's rows: no key/value is repeated.
    grouped = q.view(num_queries, num_kv_heads, -1, head_dim).permute(1, 2, 0, 3)
    scores = torch.matmul(grouped, keys.permute(1, 2, 0).unsqueeze(1)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values.transpose(0, 1).unsqueeze(1))  # [KVH, G, n, D]
    return out.permute(2, 0, 1, 3).reshape(num_queries, num_heads, head_dim)


def windowed_attention(q, keys, values, visible, scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0), attn_mask=visible, scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1])
    return out.squeeze(0).transpose(0, 1)


class MaskedAttention:
    """The windowed / soft-capped path over one forward's segments; built on first use."""

    def __init__(self, segments, block_size: int, device) -> None:
        self.segments = [s for s in segments if s.store]
        self.block_size, self.device = block_size, device
        self._index: dict[int | None, list] = {}  # per window: what each sequence reads

    def _reads(self, window: int | None) -> list:
        """Per sequence: (its rows, the blocks its window reaches, the visibility mask over
        those blocks' keys)."""
        if window not in self._index:
            reads = []
            for seg in self.segments:
                first_key = 0 if window is None else max(0, seg.num_cached + 1 - window)
                first_block = first_key // self.block_size
                last_block = -(-seg.num_context // self.block_size)
                blocks = torch.tensor(seg.block_ids[first_block:last_block], dtype=torch.long,
                                      device=self.device)
                key_start = first_block * self.block_size
                visible = visible_keys(seg.num_cached, seg.num_tokens, key_start,
                                       seg.num_context - key_start, window, self.device)
                rows = slice(seg.start, seg.start + seg.num_tokens)
                reads.append((rows, blocks, visible))
            self._index[window] = reads
        return self._index[window]

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float | None, window: int | None, softcap: float | None
                 ) -> torch.Tensor:
        """q: [T, H, D] (keys and values already stored). Returns [T, H, D]; padding rows 0."""
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        out = torch.zeros_like(q)
        for rows, blocks, visible in self._reads(window):
            num_keys = visible.shape[1]
            keys = gather_blocks(k_cache, blocks)[:num_keys]
            values = gather_blocks(v_cache, blocks)[:num_keys]
            if softcap is not None:
                out[rows] = softcapped_attention(q[rows], keys, values, visible, scale, softcap)
            else:
                out[rows] = windowed_attention(q[rows], keys, values, visible, scale)
        return out
