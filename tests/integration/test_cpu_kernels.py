"""The C++ CPU kernels agree with the torch reference ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.engine import cpu_kernels
from common.engine.models.layers import RMSNorm, RotaryEmbedding
from common.engine.ops import KernelOps, TorchOps


@pytest.fixture(scope="module")
def kernel_ops(cache_dir):
    module = cpu_kernels.load(cache_dir)
    if module is None:
        pytest.skip("no C++ compiler: the engine runs on torch ops here")
    return KernelOps(module)


TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_add_rms_norm(kernel_ops, dtype, rows):
    norm = RMSNorm(96, 1e-5).to(dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    x, residual = torch.randn(rows, 96, dtype=dtype), torch.randn(rows, 96, dtype=dtype)
    ref_out, ref_res = TorchOps().add_rms_norm(x.clone(), residual.clone(), norm)
    out, res = kernel_ops.add_rms_norm(x.clone(), residual.clone(), norm)
    torch.testing.assert_close(res, ref_res, **TOL[dtype])
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    first_out, first_res = kernel_ops.add_rms_norm(x.clone(), None, norm)
    torch.testing.assert_close(first_out, TorchOps().add_rms_norm(x, None, norm)[0], **TOL[dtype])
    assert torch.equal(first_res, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_heads(kernel_ops, dtype):
    rope = RotaryEmbedding(64, 256, 10000.0)
    qkv = torch.randn(7, 12, 64, dtype=dtype)  # rotate the first 9 "heads" only, like q+k of qkv
    positions = torch.tensor([0, 3, 9, 100, 101, 200, 255])
    ref = TorchOps().rotary(qkv[:, :9].clone(), positions, rope)
    got = kernel_ops.rotary(qkv[:, :9], positions, rope)
    torch.testing.assert_close(got, ref, **TOL[dtype])
    torch.testing.assert_close(qkv[:, :9], ref, **TOL[dtype])  # in place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
def test_silu_and_mul(kernel_ops, dtype, rows):
    gate_up = torch.randn(rows, 2 * 80, dtype=dtype) * 4
    torch.testing.assert_close(kernel_ops.silu_and_mul(gate_up), TorchOps().silu_and_mul(gate_up),
                               **TOL[dtype])


def _reference_decode(q, k_cache, v_cache, tables, lengths, scale):
    out = []
    for i, (table, length) in enumerate(zip(tables, lengths)):
        keys = k_cache[table].flatten(0, 1)[:length]
        values = v_cache[table].flatten(0, 1)[:length]
        group = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1).float()
        values = values.repeat_interleave(group, dim=1).transpose(0, 1).float()
        out.append(F.scaled_dot_product_attention(q[i].float()[:, None], keys, values,
                                                  scale=scale)[:, 0])
    return torch.stack(out).to(q.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("kv_heads,heads,dim", [(3, 9, 64), (2, 8, 128), (1, 7, 64), (4, 4, 32)])
def test_paged_decode_attention(kernel_ops, dtype, batch, kv_heads, heads, dim):
    gen = torch.Generator().manual_seed(batch)
    num_blocks, block_size = 64, 16
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    lengths = [int(x) for x in torch.randint(1, 90, (batch,), generator=gen)]
    max_blocks = -(-max(lengths) // block_size)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = [perm[i * max_blocks:(i + 1) * max_blocks].tolist() for i in range(batch)]
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    got = kernel_ops.paged_decode_attention(q, k_cache, v_cache, torch.tensor(tables),
                                            torch.tensor(lengths), 0.125)
    ref = _reference_decode(q, k_cache, v_cache, tables, lengths, 0.125)
    torch.testing.assert_close(got, ref, **TOL[dtype])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_equals_f_linear(kernel_ops, rows, with_bias):
    # Every row tile (1-6 rows, then repeats) and a partial last output block (out 45 = 2x16+13).
    if not kernel_ops.k.has_skinny_linear():
        pytest.skip("this CPU has no AVX2+FMA: float32 linears stay on oneDNN")
    from common.engine.models.layers import PackedLinear

    weight, bias = torch.randn(45, 72), torch.randn(45) if with_bias else None
    x = torch.randn(rows, 72)
    layer = PackedLinear(weight, bias, kernel_ops.k)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    strided = torch.randn(rows, 144)[:, ::2]  # not contiguous in its last dimension
    torch.testing.assert_close(layer(strided), F.linear(strided, weight, bias), atol=1e-4,
                               rtol=1e-5)
