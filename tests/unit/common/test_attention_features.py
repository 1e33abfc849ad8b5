"""Sliding windows and soft-capping in the attention path (common.engine.attention_masked) against
a dense float64 reference, and the backends that refuse them.

Batches mix decodes and prefill chunks over scattered blocks, some contexts far longer than the
window (only the blocks the window reaches are read), grouped-query heads and padding rows;
the cache's spare blocks are NaN, so reading one poisons the output.
"""

from __future__ import annotations

import pytest
import torch

from common.engine.attention import Segment, TorchAttention, UnsupportedAttention
from common.engine.kv_cache import KVCache, KVLayout
from common.engine.model_runner import attention_backend
from common.engine.models.base import LayerAttention
from common.engine.ops import TorchOps

KV_HEADS, GROUP, HEAD_DIM, BLOCK = 2, 3, 16, 8
# (new tokens, cached tokens): decodes (short, and long past any window), a 1-token chunk,
# chunks with and without a cached context
MIXED = [(1, 3), (1, 40), (1, 0), (5, 27), (19, 0), (12, 50)]


def make_batch(specs, padding=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-(n + c) // BLOCK) for n, c in specs]
    num_blocks = sum(counts) + 3
    cache = KVCache(KVLayout(1, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, "float32"), "cpu")
    cache.tensor.fill_(float("nan"))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    segments, history, row = [], [], 0
    for (n, cached), count in zip(specs, counts):
        blocks, free = free[:count], free[count:]
        segments.append(Segment(row, n, cached, blocks))
        row += n
        pos = torch.arange(cached)
        where = (torch.tensor(blocks, dtype=torch.long)[pos // BLOCK], pos % BLOCK)
        kv = torch.randn(2, cached, KV_HEADS, HEAD_DIM, generator=gen)
        cache.tensor[0, 0][where], cache.tensor[0, 1][where] = kv[0], kv[1]
        history.append(kv)
    segments.append(Segment(row, padding, 0, [], store=False))
    q, k, v = (torch.randn(row + padding, KV_HEADS * heads, HEAD_DIM, generator=gen)
               for heads in (GROUP, 1, 1))
    return segments, history, cache, q, k, v


def reference(segments, history, q, k, v, scale, window, softcap):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for seg, (old_k, old_v) in zip([s for s in segments if s.store], history):
        rows = slice(seg.start, seg.start + seg.num_tokens)
        keys = torch.cat([old_k, k[rows]]).double().repeat_interleave(GROUP, dim=1)
        values = torch.cat([old_v, v[rows]]).double().repeat_interleave(GROUP, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].double(), keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(seg.num_cached, seg.num_context)[:, None]
        key_pos = torch.arange(seg.num_context)[None, :]
        hidden = (key_pos > query_pos) | ((key_pos <= query_pos - window) if window else False)
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


def kernel_ops():
    from common.engine import cpu_kernels
    from common.engine.ops import KernelOps

    module = cpu_kernels.load("~/.cache/splitserve")
    if module is None:
        pytest.skip("the CPU kernels do not build here")
    return KernelOps(module)


@pytest.mark.parametrize("ops", ["torch", "kernels"])
@pytest.mark.parametrize("window,softcap", [(5, None), (16, None), (None, 2.0), (9, 3.0)])
def test_windowed_and_softcapped_attention_match_the_dense_reference(ops, window, softcap):
    segments, history, cache, q, k, v = make_batch(MIXED)
    ops = TorchOps() if ops == "torch" else kernel_ops()
    attention = TorchAttention(segments, cache, ops)
    out = attention(0, q, k, v, scale=0.3, window=window, softcap=softcap)
    want = reference(segments, history, q, k, v, 0.3, window, softcap)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))  # padding rows


def test_a_window_no_context_exceeds_takes_the_plain_path():
    segments, history, cache, q, k, v = make_batch(MIXED)
    cache.tensor.nan_to_num_(0.0)  # the plain decode path pads block tables with block 0
    attention = TorchAttention(segments, cache, TorchOps())
    out = attention(0, q, k, v, window=1000)
    assert attention.masked is None
    want = reference(segments, history, q, k, v, HEAD_DIM ** -0.5, None, None)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_layer_attention_passes_only_the_features_it_sets():
    assert LayerAttention().kwargs() == {"scale": None}
    assert LayerAttention(0.5, 16, None).kwargs() == {"scale": 0.5, "window": 16}
    assert LayerAttention(softcap=50.0).features() == {"softcap"}


def test_kernel_backends_refuse_windows_and_softcaps():
    pytest.importorskip("triton")
    from common.engine.attention_flash import FlashAttention
    from common.engine.attention_triton import TritonAttention

    segments, _, cache, q, k, v = make_batch([(3, 0)], padding=0)
    with pytest.raises(UnsupportedAttention, match="window"):
        TritonAttention(segments, cache)(0, q, k, v, window=4)
    with pytest.raises(UnsupportedAttention, match="softcap"):
        FlashAttention(segments, cache, TorchOps())(0, q, k, v, softcap=30.0)


def test_cuda_models_that_need_a_feature_get_torch_attention():
    layout = KVLayout(2, 64, 256, 2, 64, "float16")
    for features in ({"window"}, {"softcap"}, {"window", "softcap"}):
        assert attention_backend(torch.device("cuda"), layout, frozenset(features)) \
            is TorchAttention
