"""Attention on CUDA with our own Triton kernel over the paged KV cache: what a stock CUDA torch
ships (torch and triton), no flash-attn.

One launch per layer covers the whole flat batch (decode tokens, prefill chunks, padding rows),
after one launch that writes the new tokens' keys and values into their slots:

- the batch is cut into tiles: up to `tokens_per_tile` query tokens of one sequence (1 for a
  batch of decode tokens alone, else `PREFILL_TILE_TOKENS`); program (tile, KV head) computes
  every query head of that KV head's group for those tokens, so a grouped-query model reads each
  key/value once per tile, never a repeated copy;
- it walks the sequence's context `BLOCK_N` tokens at a time, finding each token's cache block
  in the sequence's run of block ids, so any power-of-two block size works; the runs of all
  sequences lie end to end in one tensor (no table padded to the longest context);
- query token j of a sequence with `num_cached` cached tokens sees context tokens
  0 .. num_cached + j (causal, aligned to the end of the context); softmax is online, in
  float32; padding rows (context length 0) come out as zeros.

Every index tensor a forward needs (slots, block ids, context lengths, tiles) is built once per
forward in `PagedIndex.build`, in one host-to-device copy, so `__call__` only launches kernels;
`common.engine.cuda_graphs` builds the same tensors at fixed addresses for its captured graphs.

Supported: head dims 32, 64, 128; float16, bfloat16, float32 caches (float32 dots in IEEE
precision, so float32 runs stay comparable with the CPU engine); any power-of-two block size.
Everything else is refused by `unsupported_reason`, and the runner falls back to torch attention.
Tested on CPU under Triton's interpreter (tests/unit/common/test_attention_triton.py); the
compiled kernel only runs on a CUDA GPU (tests/gpu/test_triton_attention.py, not yet run there:
no GPU was lent to the session that wrote it).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from common.engine.attention import Segment, refuse_features
from common.engine.kv_cache import KVCache, KVLayout

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install may lack triton: `available` says no, torch attends
    triton = None

SUPPORTED_HEAD_DIMS = (32, 64, 128)
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
# Query tokens of one prefill chunk per program: times the group size, the rows of one q tile.
PREFILL_TILE_TOKENS = 16
# Context tokens per inner-loop step (keys loaded and dotted at once).
BLOCK_N = 64


def unsupported_reason(layout: KVLayout) -> str | None:
    """Why the kernel cannot serve caches of this layout, or None when it can."""
    if triton is None:
        return "triton is not installed"
    if layout.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {layout.head_dim} (supported: {SUPPORTED_HEAD_DIMS})"
    if layout.dtype not in SUPPORTED_DTYPES:
        return f"dtype {layout.dtype} (supported: {SUPPORTED_DTYPES})"
    if layout.block_size <= 0 or layout.block_size & (layout.block_size - 1):
        return f"block_size {layout.block_size} is not a power of two"
    return None


def available(device: torch.device, layout: KVLayout) -> bool:
    """Whether the runner can use the kernel: CUDA, triton installed, a supported layout, and
    bfloat16 only where the GPU has it (compute capability 8.0+)."""
    if device.type != "cuda" or unsupported_reason(layout) is not None:
        return False
    return layout.dtype != "bfloat16" or torch.cuda.get_device_capability(device)[0] >= 8


def tokens_per_tile(num_tokens: list[int]) -> int:
    """1 when every sequence computes one token (decode), else PREFILL_TILE_TOKENS."""
    return 1 if max(num_tokens, default=1) <= 1 else PREFILL_TILE_TOKENS


def block_rows(tile_tokens: int, group: int) -> int:
    """Rows of a q tile: tokens x heads of a group, padded to a power of two, >= 16 (tl.dot)."""
    return max(16, 1 << (tile_tokens * group - 1).bit_length())


def plan_tiles(num_tokens: list[int], tile_tokens: int) -> tuple[list[int], list[int]]:
    """(sequence index, first query token) of every tile covering the sequences' tokens."""
    tile_seq, tile_first = [], []
    for seq, count in enumerate(num_tokens):
        for first in range(0, count, tile_tokens):
            tile_seq.append(seq)
            tile_first.append(first)
    return tile_seq, tile_first


@dataclass
class PagedIndex:
    """The int32 index tensors the kernels read, all on the cache's device."""

    slots: torch.Tensor  # [T] the cache slot of every row's key/value; -1: not stored
    seq_start: torch.Tensor  # [S] row of each sequence's first query token
    seq_tokens: torch.Tensor  # [S] query tokens of each sequence
    context_lens: torch.Tensor  # [S] context tokens each sequence attends to (0: padding)
    block_offsets: torch.Tensor  # [S] where each sequence's run of block ids starts
    block_ids: torch.Tensor  # the cache blocks of every sequence's context, end to end
    tile_seq: torch.Tensor  # [tiles] sequence of each tile
    tile_first: torch.Tensor  # [tiles] first query token (within its sequence) of each tile
    tile_tokens: int  # query tokens per tile

    @staticmethod
    def build(segments: list[Segment], block_size: int, device) -> PagedIndex:
        """From a forward's segments, with a single host-to-device copy."""
        slots, offsets, blocks = [], [], []
        for seg in segments:
            offsets.append(len(blocks))
            if not seg.store:
                slots += [-1] * seg.num_tokens
                continue
            blocks += seg.block_ids[:-(-seg.num_context // block_size)]
            for pos in range(seg.num_cached, seg.num_context):
                slots.append(seg.block_ids[pos // block_size] * block_size + pos % block_size)
        counts = [s.num_tokens for s in segments]
        tile_tokens = tokens_per_tile(counts)
        tile_seq, tile_first = plan_tiles(counts, tile_tokens)
        parts = [slots, [s.start for s in segments], counts,
                 [s.num_context if s.store else 0 for s in segments], offsets,
                 blocks + [0],  # never empty: a kernel argument must point somewhere
                 tile_seq, tile_first]
        flat = torch.tensor(list(itertools.chain.from_iterable(parts)), dtype=torch.int32,
                            device=device)
        return PagedIndex(*flat.split([len(p) for p in parts]), tile_tokens)


class TritonAttention:
    """The attention context of one forward (same interface as TorchAttention)."""

    def __init__(self, segments: list[Segment], kv_cache: KVCache, ops=None) -> None:
        index = PagedIndex.build(segments, kv_cache.layout.block_size, kv_cache.device)
        self.bind(kv_cache, index)

    @classmethod
    def over(cls, kv_cache: KVCache, index: PagedIndex) -> TritonAttention:
        """Over index tensors built by the caller (the CUDA graphs' fixed-address buffers)."""
        attention = cls.__new__(cls)
        attention.bind(kv_cache, index)
        return attention

    def bind(self, kv_cache: KVCache, index: PagedIndex) -> None:
        self.kv_cache, self.index = kv_cache, index

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float | None = None, **features) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens. Returns [T, H, D]. Sliding
        windows and soft-capping are refused (UnsupportedAttention)."""
        refuse_features("the Triton attention kernel", features)
        k_cache, v_cache = self.kv_cache.layer(layer_idx)
        store_kv(k_cache, v_cache, self.index.slots, k, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        paged_attention(out, q, k_cache, v_cache, self.index,
                        scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
        return out


def store_kv(k_cache, v_cache, slots, k, v) -> None:
    """Write keys and values [T, KVH, D] into cache slots `slots` [T]; rows whose slot is -1
    (padding, also the padding rows of a captured decode graph) are skipped. One launch for
    both: torch's index_copy_ cannot skip rows at a fixed shape, which CUDA graphs need."""
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    _store_kv_kernel[(slots.shape[0],)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), num_kv_heads,
        KV_HEADS=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1])


def paged_attention(out, q, k_cache, v_cache, index: PagedIndex, scale: float) -> None:
    """Fill `out` [T, H, D] with every row's attention over its sequence's paged context."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = block_rows(index.tile_tokens, group)
    _paged_attention_kernel[(index.tile_seq.shape[0], num_kv_heads)](
        out, q, k_cache, v_cache, index.tile_seq, index.tile_first, index.seq_start,
        index.seq_tokens, index.context_lens, index.block_offsets, index.block_ids,
        scale * math.log2(math.e), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=group, TILE_TOKENS=index.tile_tokens, BLOCK_M=rows, BLOCK_N=BLOCK_N,
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # float32 tiles are twice the bytes: two stages of keys/values in shared memory, not
        # three, so head dim 128 fits on GPUs with less shared memory than an H100
        num_warps=4 if rows <= 64 else 8, num_stages=2 if q.element_size() == 4 else 3)


if triton is not None:
    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch,
                         num_kv_heads, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr):
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        heads = tl.arange(0, KV_HEADS)[:, None]
        dims = tl.arange(0, HEAD_DIM)[None, :]
        # No head is written for slot -1. (A scalar condition is folded into the head limit:
        # Triton's interpreter mistypes `block_mask & scalar_mask`.)
        mask = (heads < tl.where(slot >= 0, num_kv_heads, 0)) & (dims < HEAD_DIM)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        key = tl.load(k_ptr + row * stride_kt + heads * stride_kh + dims, mask=mask)
        tl.store(k_cache_ptr + block * stride_kb + offset * stride_ks + heads * stride_kch + dims,
                 key, mask=mask)
        value = tl.load(v_ptr + row * stride_vt + heads * stride_vh + dims, mask=mask)
        tl.store(v_cache_ptr + block * stride_vb + offset * stride_vs + heads * stride_vch + dims,
                 value, mask=mask)

    @triton.jit
    def _softmax_step(q, keys, values, visible, acc, m_i, l_i, scale_log2,
                      PRECISION: tl.constexpr):
        """One block of keys into the running (acc, max, sum) of online softmax, base 2."""
        scores = tl.dot(q, keys, input_precision=PRECISION) * scale_log2
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old maximum
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values,
                                            input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _paged_attention_kernel(
            out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, tile_seq_ptr, tile_first_ptr,
            seq_start_ptr, seq_tokens_ptr, context_lens_ptr, block_offsets_ptr, block_ids_ptr,
            scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks,
            stride_kh, stride_vb, stride_vs, stride_vh,
            GROUP: tl.constexpr, TILE_TOKENS: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            PRECISION: tl.constexpr):
        tile, kv_head = tl.program_id(0), tl.program_id(1)
        seq = tl.load(tile_seq_ptr + tile)
        first = tl.load(tile_first_ptr + tile)
        row0 = tl.load(seq_start_ptr + seq)
        num_tokens = tl.load(seq_tokens_ptr + seq)
        context = tl.load(context_lens_ptr + seq)
        blocks_ptr = block_ids_ptr + tl.load(block_offsets_ptr + seq)  # this sequence's run
        # Row m of the tile: query token first + m // GROUP, head kv_head * GROUP + m % GROUP.
        m = tl.arange(0, BLOCK_M)
        token = first + m // GROUP
        head = kv_head * GROUP + m % GROUP
        row_ok = (m < TILE_TOKENS * GROUP) & (token < num_tokens)
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (row0 + token)[:, None] * stride_qt + head[:, None] * stride_qh
                    + dims[None, :], mask=row_ok[:, None], other=0.0)
        query_pos = context - num_tokens + token  # sees context tokens 0 .. query_pos
        last = tl.minimum(first + TILE_TOKENS, num_tokens) - 1
        end = context - num_tokens + last + 1  # keys the tile's last token sees (<= 0: none)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start in range(0, end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            key_ok = n < end
            block = tl.load(blocks_ptr + n // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            offset = n % BLOCK_SIZE
            keys = tl.load(k_cache_ptr + (block * stride_kb + offset * stride_ks)[None, :]
                           + kv_head * stride_kh + dims[:, None], mask=key_ok[None, :],
                           other=0.0)  # [HEAD_DIM, BLOCK_N]
            values = tl.load(v_cache_ptr + (block * stride_vb + offset * stride_vs)[:, None]
                             + kv_head * stride_vh + dims[None, :], mask=key_ok[:, None],
                             other=0.0)  # [BLOCK_N, HEAD_DIM]
            visible = (n[None, :] <= query_pos[:, None]) & key_ok[None, :]
            acc, m_i, l_i = _softmax_step(q, keys, values, visible, acc, m_i, l_i, scale_log2,
                                          PRECISION)
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no context (padding): zeros
        tl.store(out_ptr + (row0 + token)[:, None] * stride_ot + head[:, None] * stride_oh
                 + dims[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
