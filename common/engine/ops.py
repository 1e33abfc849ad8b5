"""The elementwise and attention primitives the models call, in two interchangeable sets.

`TorchOps` composes torch ops in transformers' exact order (float32 runs agree with transformers
token for token). `KernelOps` calls the fused C++ CPU kernels: one pass and no temporaries per op;
the runner picks it on CPU when the kernels build, except for float32 asked for by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class TorchOps:
    name = "torch"
    has_decode_kernel = False

    def has_prefill_kernel(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether prefill chunks should attend through `paged_prefill_attention`."""
        return False

    def has_varlen_kernel(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether a whole forward attends through `paged_attention`, one call per layer."""
        return False

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); with no residual yet, (norm(x), x)."""
        residual = x if residual is None else x + residual
        return norm(residual), residual

    def rotary(self, qk: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
        """Rotate queries and keys [T, heads, D] by their positions; may work in place."""
        return rope.apply(qk, *rope.table(positions, qk.dtype))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def store_kv(self, k_cache, v_cache, slots, k, v) -> None:
        """Write keys and values [n, KVH, D] into cache slots `slots` (indices into
        num_blocks * block_size)."""
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


class KernelOps(TorchOps):
    name = "cpu-kernels"
    has_decode_kernel = True

    def __init__(self, module) -> None:
        self.k = module
        self.bf16_head_dims = set(module.bf16_attention_head_dims())

    def has_prefill_kernel(self, dtype, head_dim):
        # Measured (`python -m bench.attention_kernels`, docs/engine.md): the AVX512-BF16 tiled
        # kernel beats torch's flash attention for prefill chunks at every cached length; the
        # generic kernel does not.
        return dtype == torch.bfloat16 and head_dim in self.bf16_head_dims

    def has_varlen_kernel(self, dtype, head_dim):
        # The same kernels as the prefill path, scheduled over the whole batch at once.
        return self.has_prefill_kernel(dtype, head_dim)

    def add_rms_norm(self, x, residual, norm):
        if residual is None:
            out = torch.empty_like(x)
            self.k.rms_norm(out, x, norm.weight, norm.eps)
            return out, x
        self.k.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        return x, residual

    def rotary(self, qk, positions, rope):
        if rope.rotary_dim != qk.shape[-1]:  # partial rotary: the kernel rotates whole heads
            return super().rotary(qk, positions, rope)
        self.k.rotary_neox(qk, positions, rope.cos, rope.sin)
        return qk

    def silu_and_mul(self, gate_up):
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self.k.silu_and_mul(out, gate_up)
        return out

    def store_kv(self, k_cache, v_cache, slots, k, v) -> None:
        heads_adjacent = all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
        if not heads_adjacent or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
            return super().store_kv(k_cache, v_cache, slots, k, v)
        self.k.store_kv(k_cache, v_cache, slots, k, v)

    def paged_decode_attention(self, q, k_cache, v_cache, block_table, context_lens,
                               scale: float | None) -> torch.Tensor:
        out = torch.empty_like(q)
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        self.k.paged_decode_attention(out, q, k_cache, v_cache, block_table, context_lens, scale)
        return out

    def paged_attention(self, out, q, k_cache, v_cache, seq_meta, block_ids,
                        scale: float | None) -> None:
        """Writes into `out` the attention of every sequence of a forward (see
        `common.engine.attention.varlen_index` for seq_meta and block_ids)."""
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        self.k.paged_attention(out, q, k_cache, v_cache, seq_meta, block_ids, scale)

    def paged_prefill_attention(self, out, q, k_cache, v_cache, block_table, num_cached: int,
                                scale: float | None) -> None:
        """Writes into `out` (rows of q's shape) the attention of one sequence's prefill chunk:
        q row i sees the first num_cached + i + 1 tokens of the blocks in `block_table`."""
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        self.k.paged_prefill_attention(out, q, k_cache, v_cache, block_table, num_cached, scale)


def make_ops(dtype: torch.dtype, device: torch.device, cache_dir: str,
             exact: bool = False) -> TorchOps:
    """KernelOps on CPU when the kernels build; TorchOps on other devices and for `exact` runs
    (float32 in transformers' op order) or when the kernels do not build."""
    if device.type != "cpu" or (exact and dtype == torch.float32):
        return TorchOps()
    from common.engine import cpu_kernels

    module = cpu_kernels.load(cache_dir)
    return KernelOps(module) if module is not None else TorchOps()


def skinny_kernels(ops: TorchOps, dtype: torch.dtype):
    """The kernels module when it has a skinny linear kernel for `dtype` on this CPU (float32
    on AVX2, bfloat16 on AVX512-BF16)."""
    kernels = getattr(ops, "k", None)
    if kernels is not None and str(dtype).removeprefix("torch.") in kernels.skinny_linear_dtypes():
        return kernels
    return None
