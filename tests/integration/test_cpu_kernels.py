"""The C++ CPU kernels agree with the torch reference ops they replace."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from common.engine import cpu_kernels
from common.engine.models.layers import RMSNorm
from common.engine.models.rope import RotaryEmbedding
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
@pytest.mark.parametrize("width", [96, 100])  # 100: a partial last vector of 16
def test_add_rms_norm(kernel_ops, dtype, rows, width):
    norm = RMSNorm(width, 1e-5).to(dtype)
    norm.weight.data = torch.randn(width).to(dtype)
    x, residual = torch.randn(rows, width, dtype=dtype), torch.randn(rows, width, dtype=dtype)
    ref_out, ref_res = TorchOps().add_rms_norm(x.clone(), residual.clone(), norm)
    out, res = kernel_ops.add_rms_norm(x.clone(), residual.clone(), norm)
    torch.testing.assert_close(res, ref_res, **TOL[dtype])
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    first_out, first_res = kernel_ops.add_rms_norm(x.clone(), None, norm)
    torch.testing.assert_close(first_out, TorchOps().add_rms_norm(x, None, norm)[0], **TOL[dtype])
    assert torch.equal(first_res, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 40: a partial vector of 16 per half
def test_rotary_in_place_on_strided_heads(kernel_ops, dtype, head_dim):
    rope = RotaryEmbedding(head_dim, 256, 10000.0)
    qkv = torch.randn(7, 12, head_dim, dtype=dtype)  # rotate the first 9 "heads" only, like q+k
    positions = torch.tensor([0, 3, 9, 100, 101, 200, 255])
    ref = TorchOps().rotary(qkv[:, :9].clone(), positions, rope)
    got = kernel_ops.rotary(qkv[:, :9], positions, rope)
    torch.testing.assert_close(got, ref, **TOL[dtype])
    torch.testing.assert_close(qkv[:, :9], ref, **TOL[dtype])  # in place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("width", [80, 70])
def test_silu_and_mul(kernel_ops, dtype, rows, width):
    gate_up = torch.randn(rows, 2 * width, dtype=dtype) * 4
    torch.testing.assert_close(kernel_ops.silu_and_mul(gate_up), TorchOps().silu_and_mul(gate_up),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_slots_from_a_strided_qkv_slice(kernel_ops, dtype):
    cache_shape = (8, 4, 3, 16)  # blocks, block size, KV heads, head dim
    k_cache, v_cache = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
    qkv = torch.randn(5, 9 + 2 * 3, 16).to(dtype)  # [tokens, q + k + v heads, dim]
    k, v = qkv[:, 9:12], qkv[:, 12:]
    slots = torch.tensor([31, 0, 5, 6, 17])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    TorchOps().store_kv(ref_k, ref_v, slots, k, v)
    kernel_ops.store_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert torch.equal(k_cache.view(-1, 3, 16)[31], k[0])
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel_ops.store_kv(k_cache, v_cache, torch.tensor([32]), k[:1], v[:1])


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,cached", [(2, 0), (7, 0), (16, 5), (37, 0), (40, 90), (130, 17)])
@pytest.mark.parametrize("kv_heads,heads,dim,block_size",
                         [(3, 9, 64, 16), (2, 8, 128, 16), (1, 7, 64, 8), (4, 4, 32, 16),
                          (3, 9, 64, 32)])
def test_paged_prefill_attention(kernel_ops, dtype, tokens, cached, kv_heads, heads, dim,
                                 block_size):
    """A chunk's row i sees the first cached + i + 1 tokens, wherever the blocks lie; cache
    slots past the context hold NaN, which must not leak into the output."""
    gen = torch.Generator().manual_seed(tokens + cached)
    num_blocks = 64
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.full(shape, float("nan")).to(dtype)
    v_cache = torch.full(shape, float("nan")).to(dtype)
    length = cached + tokens
    table = torch.randperm(num_blocks, generator=gen)[: -(-length // block_size)]
    flat = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:length]
    k_cache.view(-1, kv_heads, dim)[flat] = torch.randn(length, kv_heads, dim, generator=gen).to(dtype)
    v_cache.view(-1, kv_heads, dim)[flat] = torch.randn(length, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    wide = torch.zeros(tokens + 3, heads, dim, dtype=dtype)  # out as a row range of a bigger tensor
    kernel_ops.paged_prefill_attention(wide[2: 2 + tokens], q, k_cache, v_cache, table, cached,
                                       0.125)
    tables = [table.tolist()] * tokens
    lengths = list(range(cached + 1, length + 1))
    ref = _reference_decode(q, k_cache, v_cache, tables, lengths, 0.125)
    torch.testing.assert_close(wide[2: 2 + tokens], ref, **TOL[dtype])
    assert not wide[:2].any() and not wide[2 + tokens:].any()


@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("kv_heads,heads,dim,block_size",
                         [(3, 9, 64, 16), (2, 8, 128, 16), (4, 4, 64, 32), (1, 7, 64, 8)])
def test_paged_attention_mixed_batch(kernel_ops, tiles, kv_heads, heads, dim, block_size):
    """One call for a forward's decodes and prefill chunks of several sequences: every row
    equals its own reference attention (AMX tiles, where the CPU has them, and VDPBF16PS);
    NaN in every cache slot outside the contexts; out a row range of a bigger tensor."""
    if not kernel_ops.has_varlen_kernel(torch.bfloat16, dim):
        pytest.skip("no AVX512-BF16 on this CPU: the one-call kernel is not built")
    gen = torch.Generator().manual_seed(dim + block_size)
    num_blocks = 96
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.full(shape, float("nan")).bfloat16()
    v_cache = torch.full(shape, float("nan")).bfloat16()
    specs = [(1, 37), (1, 0), (17, 0), (40, 33), (1, 100), (3, 0), (64, 64), (16, 15)]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    meta, block_ids, tables, lengths, row = [], [], [], [], 0
    for tokens, cached in specs:
        table = [perm.pop() for _ in range(-(-(cached + tokens) // block_size))]
        flat = (torch.tensor(table)[:, None] * block_size + torch.arange(block_size)).flatten()
        for cache in (k_cache, v_cache):
            cache.view(-1, kv_heads, dim)[flat[:cached + tokens]] = torch.randn(
                cached + tokens, kv_heads, dim, generator=gen).bfloat16()
        meta.append([row, tokens, cached, len(block_ids)])
        block_ids += table
        tables += [table] * tokens
        lengths += list(range(cached + 1, cached + tokens + 1))
        row += tokens
    q = torch.randn(row, heads, dim, generator=gen).bfloat16()
    wide = torch.zeros(row + 3, heads, dim, dtype=torch.bfloat16)
    kernel_ops.k.paged_attention(wide[2: 2 + row], q, k_cache, v_cache, torch.tensor(meta),
                                 torch.tensor(block_ids), 0.125, tiles=tiles)
    ref = _reference_decode(q, k_cache, v_cache, tables, lengths, 0.125)
    torch.testing.assert_close(wide[2: 2 + row], ref, **TOL[torch.bfloat16])
    assert not wide[:2].any() and not wide[2 + row:].any()


def test_paged_attention_refuses_bad_indices(kernel_ops):
    if not kernel_ops.has_varlen_kernel(torch.bfloat16, 64):
        pytest.skip("no AVX512-BF16 on this CPU: the one-call kernel is not built")
    cache = torch.zeros(4, 16, 1, 64).bfloat16()
    q, out = torch.zeros(5, 2, 64).bfloat16(), torch.zeros(5, 2, 64).bfloat16()
    cases = [([[0, 6, 0, 0]], [0], "outside q"), ([[0, 5, 20, 0]], [0], "fewer blocks"),
             ([[0, 5, 0, 0]], [9], "outside the cache")]
    for meta, ids, message in cases:
        with pytest.raises(RuntimeError, match=message):
            kernel_ops.k.paged_attention(out, q, cache, cache, torch.tensor(meta),
                                         torch.tensor(ids), 0.125)


SKINNY_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 45, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_equals_f_linear(kernel_ops, dtype, rows, with_bias):
    # Every row tile (float32: 1-6 rows, bfloat16: 1-8, then repeats) and a partial last output
    # block (out 45 = 2x16+13 = 32+13).
    if str(dtype).removeprefix("torch.") not in kernel_ops.k.skinny_linear_dtypes():
        pytest.skip(f"no skinny {dtype} kernel on this CPU: those linears stay on oneDNN")
    from common.engine.models.layers import PackedLinear

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(45, 72, generator=gen).to(dtype)
    bias = torch.randn(45, generator=gen).to(dtype) if with_bias else None
    layer = PackedLinear(weight, bias, kernel_ops.k)
    assert layer.skinny is not None

    def reference(x):  # float32 sums of the same rounded inputs, rounded once
        b = bias.float() if bias is not None else None
        return F.linear(x.float(), weight.float(), b).to(dtype)

    x = torch.randn(rows, 72, generator=gen).to(dtype)
    torch.testing.assert_close(layer.skinny_forward(x), reference(x), **SKINNY_TOL[dtype])
    strided = torch.randn(rows, 144, generator=gen).to(dtype)[:, ::2]  # not contiguous rows
    torch.testing.assert_close(layer.skinny_forward(strided), reference(strided),
                               **SKINNY_TOL[dtype])


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 33, 50, 256])
def test_amx_tile_linear_equals_f_linear(kernel_ops, rows):
    """Input widths that are multiples of 32 take the AMX tile kernel on CPUs with AMX: row
    groups of 16 and 32 with partial ones, a partial last output pair (out 45 = 32 + 13)."""
    from common.engine.models.layers import AMX_TILE_MAX_ROWS, PackedLinear, can_pack

    if not can_pack(torch.bfloat16, torch.device("cpu")):  # oneDNN packs bfloat16 only on AVX-512
        pytest.skip("bfloat16 weights are not packed on this CPU (no AVX-512 BF16 path)")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(45, 96, generator=gen).bfloat16()
    bias = torch.randn(45, generator=gen).bfloat16()
    layer = PackedLinear(weight, bias, kernel_ops.k)
    if layer.skinny is None or layer.skinny_weight.dim() != 5:
        pytest.skip("no AMX tiles on this CPU")
    assert layer.skinny_max_rows == AMX_TILE_MAX_ROWS
    for x in (torch.randn(rows, 96, generator=gen).bfloat16(),
              torch.randn(rows, 192, generator=gen).bfloat16()[:, 96:]):  # strided rows
        exact = F.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(layer(x), exact.bfloat16(), **SKINNY_TOL[torch.bfloat16])
        # float32 out (the logits): the sums unrounded
        torch.testing.assert_close(layer.forward_float32(x), exact, atol=1e-3, rtol=1e-4)


def test_bfloat16_skinny_kernel_skips_odd_input_widths(kernel_ops):
    if "bfloat16" not in kernel_ops.k.skinny_linear_dtypes():
        pytest.skip("no skinny bfloat16 kernel on this CPU")
    from common.engine.models.layers import PackedLinear

    weight = torch.randn(16, 33).bfloat16()  # the kernel reads input features in pairs
    layer = PackedLinear(weight, None, kernel_ops.k)
    assert layer.skinny is None
    x = torch.randn(2, 33).bfloat16()
    torch.testing.assert_close(layer(x), F.linear(x, weight), atol=3e-2, rtol=1e-2)


def test_skinny_row_limit_keeps_onednn_for_batches_on_amx(kernel_ops, monkeypatch):
    """On AMX CPUs oneDNN's tiles outpace VDPBF16PS beyond decode rows: the limit drops to 8
    (for weights the AMX tile kernel does not take: input width not a multiple of 32)."""
    if "bfloat16" not in kernel_ops.k.skinny_linear_dtypes():
        pytest.skip("no skinny bfloat16 kernel on this CPU")
    from common.engine.models import layers

    weight = torch.randn(64, 34).to(torch.bfloat16)
    monkeypatch.setattr(layers, "has_amx", lambda: False)
    assert layers.PackedLinear(weight, None, kernel_ops.k).skinny_max_rows == 256
    monkeypatch.setattr(layers, "has_amx", lambda: True)
    assert layers.PackedLinear(weight, None, kernel_ops.k).skinny_max_rows == 8


def test_a_kernel_lets_the_instance_s_other_threads_run(kernel_ops):
    """The kernels release the GIL. With a switch interval too long to ever force a switch,
    the waiting thread can get the interpreter only when the calling thread lets go of it,
    which in the loop below only a kernel call can do (the KV server thread answering a read
    during a forward relies on it)."""
    x, out, weight = torch.randn(64, 4096), torch.empty(64, 4096), torch.ones(4096)
    calls, seen = [0], []
    go = threading.Lock()
    go.acquire()
    waiter = threading.Thread(target=lambda: go.acquire() and seen.append(calls[0]))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        waiter.start()
        go.release()
        while not seen and calls[0] < 2000:
            kernel_ops.k.rms_norm(out, x, weight, 1e-5)
            calls[0] += 1
        made = calls[0]
    finally:
        sys.setswitchinterval(interval)
    waiter.join()
    assert seen[0] < made, f"the waiting thread ran only after all {made} kernel calls"
