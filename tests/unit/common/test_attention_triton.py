"""The Triton paged attention kernel (common.engine.attention_triton) against a per-sequence
float32 reference: each sequence's context gathered from its blocks, the causal mask aligned to
the end of the context, torch's SDPA.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET before triton is imported); with one, the compiled kernels run on it. Shapes are
small: the interpreter runs each program in numpy. The interpreter's tl.dot is wrong for
bfloat16, so bfloat16 is checked on a GPU only (tests/gpu/test_triton_attention.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from common.engine import attention_triton as at  # noqa: E402
from common.engine.attention import Segment  # noqa: E402
from common.engine.kv_cache import KVCache, KVLayout  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_HEADS = 2
# (new tokens, cached tokens) per sequence: decodes (one over nothing, some ending mid-block,
# one past a BLOCK_N step), a 1-token chunk, prefill chunks with and without cached context,
# longer than one tile and crossing a BLOCK_N step.
MIXED = [(1, 16), (1, 37), (1, 100), (1, 0), (5, 27), (19, 0), (17, 40), (20, 70)]
DECODES = [(1, 0), (1, 15), (1, 16), (1, 31), (1, 64), (1, 100)]


@pytest.fixture(autouse=True)
def _kernels_run_here():
    if DEVICE == "cpu" and type(at._paged_attention_kernel).__name__ != "InterpretedFunction":
        pytest.skip("no GPU and TRITON_INTERPRET was not set before triton was imported")


def make_batch(specs, group, block_size, head_dim, dtype, padding=0, seed=0):
    """Segments over scattered blocks of a NaN-filled cache whose cached contexts are random,
    and q/k/v for the batch's rows (the padding rows' too)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-(n + c) // block_size) for n, c in specs]
    num_blocks = sum(counts) + 3  # spare blocks stay NaN: reading one poisons the output
    cache = KVCache(KVLayout(1, num_blocks, block_size, KV_HEADS, head_dim, dtype), DEVICE)
    cache.tensor.fill_(float("nan"))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    segments, row = [], 0
    for (n, cached), count in zip(specs, counts):
        blocks, free = free[:count], free[count:]
        segments.append(Segment(row, n, cached, blocks))
        row += n
        pos = torch.arange(cached)
        where = (torch.tensor(blocks, dtype=torch.long)[pos // block_size], pos % block_size)
        for kv in (0, 1):
            cache.tensor[0, kv][where] = torch.randn(cached, KV_HEADS, head_dim,
                                                     generator=gen).to(cache.tensor)
    if padding:
        segments.append(Segment(row, padding, 0, [], store=False))
        row += padding
    q, k, v = (torch.randn(row, KV_HEADS * heads, head_dim, generator=gen).to(cache.tensor)
               for heads in (group, 1, 1))
    return segments, cache, q, k, v


def context_of(cache_plane, seg, new, block_size):
    """[num_context, KVH, D] float32: the cached tokens from their blocks, then the new ones."""
    pos = torch.arange(seg.num_cached, device=cache_plane.device)
    blocks = torch.tensor(seg.block_ids, dtype=torch.long, device=cache_plane.device)
    cached = cache_plane[blocks[pos // block_size], pos % block_size]
    return torch.cat([cached, new]).float()


def reference(segments, cache_before, q, k, v, block_size, scale):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for seg in segments:
        if not seg.store:
            continue
        rows = slice(seg.start, seg.start + seg.num_tokens)
        keys = context_of(cache_before[0, 0], seg, k[rows], block_size)
        values = context_of(cache_before[0, 1], seg, v[rows], block_size)
        query_pos = torch.arange(seg.num_cached, seg.num_context, device=q.device)
        mask = torch.arange(seg.num_context, device=q.device)[None, :] <= query_pos[:, None]
        out[rows] = F.scaled_dot_product_attention(
            q[rows].float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
    return out


def expected_cache(cache_before, segments, k, v, block_size):
    expected = cache_before.clone()
    for seg in segments:
        if not seg.store:
            continue
        for j, pos in enumerate(range(seg.num_cached, seg.num_context)):
            block, offset = seg.block_ids[pos // block_size], pos % block_size
            expected[0, 0, block, offset] = k[seg.start + j]
            expected[0, 1, block, offset] = v[seg.start + j]
    return expected


def check(specs, group, block_size, head_dim, dtype, padding=0, scale=None):
    segments, cache, q, k, v = make_batch(specs, group, block_size, head_dim, dtype, padding)
    before = cache.tensor.clone()
    out = at.TritonAttention(segments, cache)(0, q, k, v, scale)
    want = reference(segments, before, q, k, v, block_size,
                     scale if scale is not None else 1 / math.sqrt(head_dim))
    tolerance = 1e-5 if dtype == "float32" else 3e-3
    torch.testing.assert_close(out.float(), want, atol=tolerance, rtol=tolerance)
    # the new tokens' keys/values are in their slots and nothing else changed (padding rows
    # wrote nothing; NaN slots stay NaN)
    torch.testing.assert_close(cache.tensor, expected_cache(before, segments, k, v, block_size),
                               atol=0, rtol=0, equal_nan=True)
    if padding:
        assert torch.equal(out[-padding:], torch.zeros_like(out[-padding:]))


@pytest.mark.parametrize("group,block_size,head_dim,dtype", [
    (1, 16, 64, "float32"), (3, 32, 128, "float32"), (4, 16, 128, "float16"),
    (3, 16, 64, "float16"), (4, 32, 32, "float32")])
def test_mixed_batch_matches_reference(group, block_size, head_dim, dtype):
    check(MIXED, group, block_size, head_dim, dtype, padding=3)


@pytest.mark.parametrize("group", [1, 3, 4])
def test_decode_batch_matches_reference(group):
    check(DECODES, group, 16, 64, "float32")


def test_explicit_scale_and_single_chunk():
    check([(33, 0)], 3, 16, 64, "float32", scale=1.0)  # OPT attends with scale 1.0
    check([(1, 0)], 1, 32, 64, "float32")


def test_padding_only_batch_gives_zeros_and_writes_nothing():
    check([], 1, 16, 64, "float32", padding=4)


def test_paged_index_lists_slots_contexts_and_tiles():
    segments = [Segment(0, 1, 20, [7, 3, 8]), Segment(1, 18, 5, [4, 9]),
                Segment(19, 2, 0, [], store=False)]
    index = at.PagedIndex.build(segments, 16, "cpu")
    assert index.slots.tolist() == [3 * 16 + 4] + [4 * 16 + p for p in range(5, 16)] + [
        9 * 16 + p for p in range(0, 7)] + [-1, -1]
    assert index.seq_start.tolist() == [0, 1, 19]
    assert index.seq_tokens.tolist() == [1, 18, 2]
    assert index.context_lens.tolist() == [21, 23, 0]
    # each sequence's blocks end to end (as many as its context needs), padding reads none
    assert index.block_offsets.tolist() == [0, 2, 4]
    assert index.block_ids.tolist()[:4] == [7, 3, 4, 9]
    assert index.tile_tokens == at.PREFILL_TILE_TOKENS == 16
    assert index.tile_seq.tolist() == [0, 1, 1, 2]
    assert index.tile_first.tolist() == [0, 0, 16, 0]
    assert {t.dtype for t in vars(index).values() if isinstance(t, torch.Tensor)} == {
        torch.int32}


def test_tiles_and_rows():
    assert at.tokens_per_tile([1, 1, 1]) == 1
    assert at.tokens_per_tile([1, 2]) == at.PREFILL_TILE_TOKENS
    assert at.plan_tiles([1, 33, 16], 16) == ([0, 1, 1, 1, 2], [0, 0, 16, 32, 0])
    # tl.dot needs at least 16 rows; a group's heads never straddle two tiles
    assert [at.block_rows(1, g) for g in (1, 3, 4, 8, 32)] == [16, 16, 16, 16, 32]
    assert [at.block_rows(16, g) for g in (1, 3, 4, 7)] == [16, 64, 64, 128]


def test_unsupported_layouts_are_refused_with_a_reason():
    def layout(head_dim=64, dtype="float16", block_size=16):
        return KVLayout(2, 8, block_size, 2, head_dim, dtype)

    assert at.unsupported_reason(layout()) is None
    assert at.unsupported_reason(layout(block_size=256)) is None
    assert "head_dim 96" in at.unsupported_reason(layout(head_dim=96))
    assert "head_dim 256" in at.unsupported_reason(layout(head_dim=256))
    assert "power of two" in at.unsupported_reason(layout(block_size=24))
    assert not at.available(torch.device("cpu"), layout())  # the runner's CPU path stays torch
