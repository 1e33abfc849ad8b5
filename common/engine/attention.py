"""Attention over the paged KV cache: the per-forward context every attention layer calls.

A forward's flat batch is a list of segments, one per sequence: `num_tokens` query tokens whose
positions start at `num_cached` (the tokens already in the KV cache). Decode segments
(num_tokens == 1) come first in the batch, prefill chunks after them:

    rows:  | d0 | d1 | ... | d(n-1) | chunk of seq A ......... | chunk of seq B .... |
           '----- decode tokens ----'------------- prefill chunks -----------------'

Each layer first writes the new keys/values into their slots, then attends. Where the ops have
the one-call kernel (bfloat16 on AVX512-BF16 CPUs, `paged_attention`), every sequence of the
batch, decodes and chunks, goes through it in one call per layer, row i of a chunk seeing the
first num_cached + i + 1 tokens. Elsewhere:
- one-token segments (decodes) as one batched call: every sequence's blocks are gathered into a
  padded [B, L] view and masked past its length (or read in place by the decode kernel);
  grouped-query heads are folded into the query axis so no key/value is repeated;
- each prefill chunk on its own, causally and aligned to the end of its context, with torch's
  SDPA.

A layer that asks for a sliding window (shorter than some context of the forward) or for
attention-logit soft-capping goes through `common.engine.attention_masked` instead, in torch; the
kernels above compute neither. Which backend computes what:

    backend                               causal  window  softcap
    TorchAttention, torch ops             yes     yes     yes     (SDPA / masked path)
    TorchAttention, C++ kernels (CPU)     yes     yes     yes     (those layers: masked path)
    FlashAttention (CUDA, flash-attn)     yes     refused refused
    TritonAttention (CUDA)                yes     refused refused

The runner never gives a model that needs a feature a backend which refuses it
(`common.engine.model_runner.attention_backend`); a refused call raises rather than ignoring it.

`TorchAttention` runs on any device; `common.engine.attention_flash` replaces it on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.engine.attention_masked import MaskedAttention, gather_blocks
from common.engine.kv_cache import DTYPE_BY_NAME, KVCache
from common.engine.ops import TorchOps


@dataclass(frozen=True)
class Segment:
    """One sequence's share of a forward."""

    start: int  # row of its first token in the flat batch
    num_tokens: int  # query tokens computed in this forward
    num_cached: int  # tokens already in the KV cache before this forward
    block_ids: list[int]
    store: bool = True  # False for padding rows: computed, never written to the cache

    @property
    def num_context(self) -> int:
        return self.num_cached + self.num_tokens


class UnsupportedAttention(NotImplementedError):
    """A backend was asked for a feature (window, softcap) it does not compute."""


def refuse_features(backend: str, features: dict) -> None:
    """Raise for any feature a kernel backend would otherwise silently ignore."""
    asked = sorted(name for name, value in features.items() if value is not None)
    if asked:
        raise UnsupportedAttention(f"{backend} does not compute {', '.join(asked)}; the runner "
                                   "picks TorchAttention for models that need it")


def slot_mapping(segments: list[Segment], block_size: int) -> list[int]:
    """The KV slot (block_id * block_size + offset) of every token in the flat batch."""
    slots: list[int] = []
    for seg in segments:
        if not seg.store:
            continue
        for pos in range(seg.num_cached, seg.num_context):
            slots.append(seg.block_ids[pos // block_size] * block_size + pos % block_size)
    return slots


class TorchAttention:
    """Attention with torch's scaled_dot_product_attention, built once per forward."""

    def __init__(self, segments: list[Segment], kv_cache: KVCache, ops: TorchOps) -> None:
        device = kv_cache.device
        self.kv_cache = kv_cache
        self.ops = ops
        layout = kv_cache.layout
        block_size = layout.block_size
        self.slots = torch.tensor(slot_mapping(segments, block_size), dtype=torch.long,
                                  device=device)
        # Padding rows attend to nothing: their output is zero (and never read).
        self.padding = [s for s in segments if not s.store]
        self.segments = segments
        self.max_context = max((s.num_context for s in segments if s.store), default=0)
        self.masked: MaskedAttention | None = None  # windows and soft-caps, built when asked
        self.varlen = ops.has_varlen_kernel(DTYPE_BY_NAME[layout.dtype], layout.head_dim)
        if self.varlen:
            self.seq_meta, self.block_ids = varlen_index(segments, block_size, device)
            return
        # Prefill chunks through the paged kernel too, where it is the faster path (ops decide).
        self.paged_prefill = ops.has_prefill_kernel(DTYPE_BY_NAME[layout.dtype],
                                                    layout.head_dim)
        decodes = _leading_single_token(segments)
        self.num_decode = len(decodes)
        self.decode_blocks = self.decode_mask = None
        if decodes:
            self._build_decode(decodes, block_size, device)
        self.prefills = [self._build_prefill(s, block_size, device)
                         for s in segments[self.num_decode:] if s.store]

    def _build_decode(self, decodes: list[Segment], block_size: int, device) -> None:
        max_blocks = max(-(-s.num_context // block_size) for s in decodes)
        table = [s.block_ids[:max_blocks] + [0] * (max_blocks - len(s.block_ids[:max_blocks]))
                 for s in decodes]
        lengths = torch.tensor([s.num_context for s in decodes], device=device)
        if self.ops.has_decode_kernel:  # the kernel reads blocks in place: table + lengths
            self.decode_table = torch.tensor(table, dtype=torch.long, device=device)
            self.decode_lengths = lengths
            return
        self.decode_blocks = torch.tensor(table, dtype=torch.long, device=device).flatten()
        span = max_blocks * block_size
        if bool((lengths == span).all()):
            return  # no padding, no mask
        mask = torch.arange(span, device=device)[None, :] < lengths[:, None]
        self.decode_mask = mask[:, None, None, :]  # [B, 1, 1, L]

    def _build_prefill(self, seg: Segment, block_size: int, device):
        if self.paged_prefill:  # query row i attends to the first num_cached + i + 1 tokens
            num_blocks = -(-seg.num_context // block_size)
            table = torch.tensor(seg.block_ids[:num_blocks], dtype=torch.long, device=device)
            return seg, table, None
        if seg.num_cached == 0:
            return seg, None, None  # attends only to its own new tokens: plain causal
        num_blocks = -(-seg.num_context // block_size)
        blocks = torch.tensor(seg.block_ids[:num_blocks], dtype=torch.long, device=device)
        key_pos = torch.arange(seg.num_context, device=device)
        query_pos = torch.arange(seg.num_cached, seg.num_context, device=device)
        return seg, blocks, key_pos[None, :] <= query_pos[:, None]  # [n, context]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float | None = None, window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens. Returns [T, H, D]. `window`
        and `softcap`: see `common.engine.models.base.LayerAttention`."""
        k_cache, v_cache = self.kv_cache.layer(layer_idx)  # [num_blocks, block_size, KVH, D]
        num_stored = self.slots.shape[0]  # stored rows come first; padding rows last
        self.ops.store_kv(k_cache, v_cache, self.slots, k[:num_stored], v[:num_stored])
        # A window no context of this forward exceeds is plain causal attention.
        if softcap is not None or (window is not None and window < self.max_context):
            if self.masked is None:
                self.masked = MaskedAttention(self.segments, k_cache.shape[1], q.device)
            return self.masked(q, k_cache, v_cache, scale, window, softcap)
        if self.varlen:
            return self._varlen(q, k_cache, v_cache, scale)
        if self.num_decode == q.shape[0]:  # decodes only: the kernel's output is the result
            return self._decode(q, k_cache, v_cache, scale)
        out = torch.empty_like(q)
        if self.num_decode:
            out[: self.num_decode] = self._decode(q[: self.num_decode], k_cache, v_cache, scale)
        for seg in self.padding:
            out[seg.start: seg.start + seg.num_tokens] = 0
        for seg, blocks, mask in self.prefills:
            rows = slice(seg.start, seg.start + seg.num_tokens)
            if self.paged_prefill:  # blocks: the sequence's block table
                self.ops.paged_prefill_attention(out[rows], q[rows], k_cache, v_cache, blocks,
                                                 seg.num_cached, scale)
                continue
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, blocks, mask,
                                      seg.num_context, scale)
        return out

    def _varlen(self, q, k_cache, v_cache, scale):
        out = torch.empty_like(q)
        for seg in self.padding:
            out[seg.start: seg.start + seg.num_tokens] = 0
        if self.seq_meta.shape[0]:
            self.ops.paged_attention(out, q, k_cache, v_cache, self.seq_meta, self.block_ids,
                                     scale)
        return out

    def _decode(self, q, k_cache, v_cache, scale):
        if self.ops.has_decode_kernel:
            return self.ops.paged_decode_attention(q, k_cache, v_cache, self.decode_table,
                                                   self.decode_lengths, scale)
        batch, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        # [B * max_blocks * block_size, KVH, D] -> [B, KVH, L, D]
        keys = gather_blocks(k_cache, self.decode_blocks).view(batch, -1, num_kv_heads, head_dim)
        values = gather_blocks(v_cache, self.decode_blocks).view(batch, -1, num_kv_heads, head_dim)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        # Query heads of one KV group act as that group's query rows: [B, KVH, H / KVH, D]
        grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=self.decode_mask,
                                             scale=scale)
        return out.reshape(batch, num_heads, head_dim)

    def _prefill(self, q, k, v, k_cache, v_cache, blocks, mask, num_context, scale):
        if blocks is None:
            keys, values, causal = k, v, True
        else:
            keys = gather_blocks(k_cache, blocks)[:num_context]
            values = gather_blocks(v_cache, blocks)[:num_context]
            causal = False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])
        return out.squeeze(0).transpose(0, 1)


def varlen_index(segments: list[Segment], block_size: int, device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the one-call kernel reads: int64 [S, 4] rows (first query row, query tokens, cached
    tokens, offset of its block ids) for the stored segments, and their block ids end to end."""
    meta: list[int] = []
    block_ids: list[int] = []
    for seg in segments:
        if not seg.store:
            continue
        meta += [seg.start, seg.num_tokens, seg.num_cached, len(block_ids)]
        block_ids += seg.block_ids[:-(-seg.num_context // block_size)]
    as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)
    return as_long(meta).view(-1, 4), as_long(block_ids)


def _leading_single_token(segments: list[Segment]) -> list[Segment]:
    """The run of one-token segments the batch starts with (decodes, or 1-token chunks)."""
    count = 0
    while count < len(segments) and segments[count].num_tokens == 1 and segments[count].store:
        count += 1
    return segments[:count]
