"""CUDA: the Triton paged attention kernel (common.engine.attention_triton) equals the torch
attention path (TorchAttention) on the GPU, at real sizes, in float16, bfloat16 and float32, and
writes the same cache bytes; the runner picks it on CUDA without flash-attn.

Skipped without CUDA (tests/conftest.py skips `gpu` tests). Not yet run on a GPU: no GPU was
lent to the session that wrote it.
"""

from __future__ import annotations

import pytest
import torch

from common.engine.attention import Segment, TorchAttention
from common.engine.kv_cache import KVCache, KVLayout
from common.engine.model_runner import attention_backend
from common.engine.ops import TorchOps

pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")

from common.engine.attention_triton import TritonAttention  # noqa: E402

KV_HEADS = 8
# decodes over long and mid-block contexts, prefill chunks with and without cached context
MIXED = [(1, 0), (1, 17), (1, 1000), (1, 3071), (700, 1500), (513, 0), (64, 64)]
TOLERANCE = {"float32": 2e-4, "float16": 3e-3, "bfloat16": 2e-2}


def batch(specs, group, block_size, head_dim, dtype, padding=0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    counts = [-(-(n + c) // block_size) for n, c in specs]
    num_blocks = sum(counts) + 8
    cache = KVCache(KVLayout(1, num_blocks, block_size, KV_HEADS, head_dim, dtype), "cuda")
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen, device="cuda"))
    free = torch.randperm(num_blocks, generator=gen, device="cuda").tolist()
    segments, row = [], 0
    for (n, cached), count in zip(specs, counts):
        segments.append(Segment(row, n, cached, free[:count]))
        free, row = free[count:], row + n
    if padding:
        segments.append(Segment(row, padding, 0, [], store=False))
        row += padding
    q, k, v = (torch.randn(row, KV_HEADS * heads, head_dim, generator=gen, device="cuda")
               .to(cache.tensor.dtype) for heads in (group, 1, 1))
    return segments, cache, q, k, v


def compare(specs, group, block_size, head_dim, dtype, padding=0):
    segments, cache, q, k, v = batch(specs, group, block_size, head_dim, dtype, padding)
    reference_cache = KVCache(cache.layout, "cuda")
    reference_cache.tensor.copy_(cache.tensor)
    out = TritonAttention(segments, cache)(0, q, k, v)
    want = TorchAttention(segments, reference_cache, TorchOps())(0, q, k, v)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(cache.tensor, reference_cache.tensor)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("group,head_dim,block_size", [(1, 64, 16), (3, 64, 16), (4, 128, 32),
                                                       (4, 64, 256)])
def test_mixed_batch_equals_torch_attention(dtype, group, head_dim, block_size):
    compare(MIXED, group, block_size, head_dim, dtype, padding=5)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_decode_batch_equals_torch_attention(dtype):
    lengths = torch.randint(0, 2048, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    compare([(1, n) for n in lengths], 4, 16, 128, dtype)


def test_runner_picks_the_triton_kernel_without_flash_attn():
    layout = KVLayout(2, 64, 16, 2, 64, "float16")  # flash-attn needs blocks of 256 tokens
    assert attention_backend(torch.device("cuda"), layout) is TritonAttention
    odd = KVLayout(2, 64, 16, 2, 96, "float16")
    assert attention_backend(torch.device("cuda"), odd) is TorchAttention
