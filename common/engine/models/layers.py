"""Building blocks shared by the model families: norms, activations, fused-weight loading, packed
matmuls. Rotary embeddings live in `common.engine.models.rope`.

Numerics follow transformers where it matters for exact float32 agreement: RMSNorm normalizes in
float32 and casts back before the weight multiply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.cpu_features import has_amx, native_matmul_dtypes
from common.errors import ModelLoadError


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype != torch.float32:
            # torch's fused kernel; float32 keeps transformers' exact op order below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def activation(name: str):
    table = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu,
             "gelu_new": tanh_gelu, "gelu_pytorch_tanh": tanh_gelu}
    if name not in table:
        raise ModelLoadError(f"unsupported activation {name!r}")
    return table[name]


class WeightLoader:
    """Copies checkpoint tensors into parameters, including shards of fused parameters.

    `fused` maps a checkpoint name suffix to (our parameter suffix, shard index); shard sizes come
    from `shard_sizes[our suffix]`. Every parameter must be written exactly once in full.
    """

    def __init__(self, module: nn.Module, fused: dict[str, tuple[str, int]],
                 shard_sizes: dict[str, list[int]], ignore: tuple[str, ...] = ()) -> None:
        self.params = dict(module.named_parameters())
        self.fused, self.shard_sizes, self.ignore = fused, shard_sizes, ignore
        self.filled: dict[str, int] = {}

    def _target(self, name: str) -> tuple[str, int | None]:
        for suffix, (ours, shard) in self.fused.items():
            if name.endswith(suffix):
                return name[: -len(suffix)] + ours, shard
        return name, None

    def load(self, name: str, tensor: torch.Tensor) -> None:
        if any(part in name for part in self.ignore):
            return
        target, shard = self._target(name)
        param = self.params.get(target)
        if param is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
        view = param.data
        if shard is not None:
            sizes = next(v for k, v in self.shard_sizes.items() if target.endswith(k))
            start = sum(sizes[:shard])
            view = view.narrow(0, start, sizes[shard])
        if tuple(view.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model "
                                 f"expects {tuple(view.shape)}")
        view.copy_(tensor)
        self.filled[target] = self.filled.get(target, 0) + tensor.numel()

    def check_complete(self, tied: tuple[str, ...] = ()) -> None:
        missing = [name for name, p in self.params.items()
                   if name not in tied and self.filled.get(name, 0) != p.numel()]
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, "
                                 f"e.g. {missing[:3]}")


# Up to this many rows, a PackedLinear with the skinny kernel uses it instead of oneDNN
# (`python -m bench.linear_kernels`): float32 on the AVX2 EPYC, 1.2-2.4x faster up to 64 rows,
# equal at 128; bfloat16 on the AVX512-BF16 EPYC, 1.7-2.7x faster up to 8 rows and, since it
# prefetches the next weight slice, 1.1-1.4x at 16-192 rows, equal at 256-512.
# Not measured on a CPU with AMX, where oneDNN's bfloat16 matmuls use the tiles: there the
# VDPBF16PS kernel keeps only the decode rows it was first built for...
SKINNY_MAX_ROWS = {torch.float32: 64, torch.bfloat16: 256}
SKINNY_MAX_ROWS_WITH_AMX = {torch.float32: 64, torch.bfloat16: 8}
# ...and weights whose input width is a multiple of 32 take the AMX tile kernel instead
# (csrc/amx_linear_bf16.h; its packed weight is 5-d): on the seventh session's 2-core Xeon
# 1.1-1.7x faster than oneDNN at 1-256 rows, equal or slower from 512.
AMX_TILE_MAX_ROWS = 256


class PackedLinear(nn.Module):
    """A linear layer whose weight oneDNN has reordered once for this CPU.

    For bfloat16 on CPU this is about twice as fast as `F.linear` for the skinny matmuls of
    decoding (one to a few dozen rows) and a little faster for prefill chunks. Given `skinny`
    (the CPU kernels module with a skinny kernel for the weight's dtype), it also keeps the
    weight in that kernel's layout and runs forwards of up to SKINNY_MAX_ROWS rows through it.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, skinny=None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        self.bias = bias.detach() if bias is not None else None
        self.skinny = skinny if _skinny_fits(weight, skinny) else None
        limits = SKINNY_MAX_ROWS_WITH_AMX if has_amx() else SKINNY_MAX_ROWS
        self.skinny_max_rows = limits.get(weight.dtype, 0)
        if self.skinny is not None:
            self.skinny_weight = skinny.skinny_pack(weight.detach())
            self.skinny_bias = self.bias if self.bias is not None else weight.new_empty(0)
            if self.skinny_weight.dim() == 5:
                self.skinny_max_rows = AMX_TILE_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny is not None and x.dim() == 2 and x.shape[0] <= self.skinny_max_rows:
            return self.skinny_forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """The output in float32 (the logits): the AMX tile kernel writes its float32 sums
        directly, without rounding them to bfloat16 and converting back."""
        if (self.skinny is not None and self.skinny_weight.dim() == 5 and x.dim() == 2
                and x.shape[0] <= self.skinny_max_rows):
            out = x.new_empty(x.shape[0], self.out_features, dtype=torch.float32)
            self.skinny.skinny_linear(out, x if x.stride(1) == 1 else x.contiguous(),
                                      self.skinny_weight, self.skinny_bias)
            return out
        return self(x).float()

    def skinny_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] through the skinny kernel, whatever the row count."""
        out = x.new_empty(x.shape[0], self.out_features)
        self.skinny.skinny_linear(out, x if x.stride(1) == 1 else x.contiguous(),
                                  self.skinny_weight, self.skinny_bias)
        return out


def _skinny_fits(weight: torch.Tensor, skinny) -> bool:
    """Whether the skinny kernels module takes this weight (bfloat16 reads inputs in pairs)."""
    if skinny is None:
        return False
    dtype = str(weight.dtype).removeprefix("torch.")
    even_width = weight.shape[1] % 2 == 0
    return dtype in skinny.skinny_linear_dtypes() and (dtype != "bfloat16" or even_width)


def can_pack(dtype: torch.dtype, device: torch.device, exact: bool = False) -> bool:
    """Whether to pack weights for oneDNN: reduced precision where the CPU runs it natively
    (oneDNN raises otherwise), and float32 unless exact agreement with `F.linear` is wanted."""
    if device.type != "cpu" or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.float32:
        return not exact and torch.backends.mkldnn.is_available()
    return dtype in (torch.bfloat16, torch.float16) and dtype in native_matmul_dtypes()


def pack_linears(module: nn.Module, skip: tuple[str, ...] = (), skinny=None) -> int:
    """Replace every nn.Linear below `module` (but the children named in `skip`) by a
    PackedLinear (with the skinny kernel when given). Returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if name in skip:
            continue
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias, skinny))
            count += 1
        else:
            count += pack_linears(child, skinny=skinny)
    return count
