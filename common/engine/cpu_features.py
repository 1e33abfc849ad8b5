"""Which matmul dtypes this CPU runs natively, and so which dtype "auto" means on it.

oneDNN runs bfloat16 and float16 matmuls in hardware only on CPUs with the matching
instructions (AVX512-BF16/AVX512BW or AVX-NE-CONVERT; AVX512-FP16 or AMX-FP16). Elsewhere torch
falls back to a reference path: on a 2-core AVX2-only EPYC, bfloat16 `F.linear` ran at 18
GFLOP/s against 155 for float32 (docs/engine.md), and oneDNN's weight packing refuses bfloat16
outright. So "auto" is bfloat16 only where it is native, float32 otherwise.
"""

from __future__ import annotations

import functools

import torch


def _supported(probe_name: str) -> bool:
    probe = getattr(torch.ops.mkldnn, probe_name, None)
    try:
        return bool(probe()) if probe is not None else False
    except (RuntimeError, AttributeError):
        return False


@functools.cache
def native_matmul_dtypes() -> frozenset[torch.dtype]:
    """The dtypes whose CPU matmuls run on this CPU's own instructions (float32 always)."""
    dtypes = {torch.float32}
    if torch.backends.mkldnn.is_available():
        if _supported("_is_mkldnn_bf16_supported"):
            dtypes.add(torch.bfloat16)
        if _supported("_is_mkldnn_fp16_supported"):
            dtypes.add(torch.float16)
    return frozenset(dtypes)


@functools.cache
def has_amx() -> bool:
    """Whether this CPU has AMX tiles (Sapphire Rapids and later), where oneDNN's bfloat16
    matmuls run on them and outpace our VDPBF16PS kernels beyond a few rows."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def default_cpu_dtype() -> str:
    """What dtype "auto" resolves to on this CPU."""
    return "bfloat16" if torch.bfloat16 in native_matmul_dtypes() else "float32"


def describe() -> str:
    """One line for logs and `splitserve profile`: the capability torch sees and native dtypes."""
    names = sorted(str(d).removeprefix("torch.") for d in native_matmul_dtypes())
    return f"{torch.backends.cpu.get_cpu_capability()}, native matmul dtypes: {', '.join(names)}"
