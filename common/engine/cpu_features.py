"""Which matmul dtypes this CPU runs natively, and so which dtype "auto" means on it.

oneDNN runs bfloat16 and float16 matmuls in hardware only on CPUs with the matching
instructions (AVX512-BF16/AVX512BW or AVX-NE-CONVERT; AVX512-FP16 or AMX-FP16). Elsewhere torch
falls back to a reference path: on a 2-core AVX2-only EPYC, bfloat16 `F.linear` ran at 18
GFLOP/s against 155 for float32 (docs/engine.md), and oneDNN's weight packing refuses bfloat16
outright. oneDNN's own "bfloat16 supported" answer is not enough: it says yes on any AVX-512
CPU and converts in software where AVX512-BF16 is missing (an Intel Xeon with AVX-512 but no
AVX512-BF16: bfloat16 `F.linear` 52 GFLOP/s, float32 190). So "auto" is bfloat16 only where
the CPU has the instructions too, float32 otherwise.
"""

from __future__ import annotations

import functools

import torch


def _supported(probe_name: str, namespace=torch.ops.mkldnn) -> bool:
    probe = getattr(namespace, probe_name, None)
    try:
        return bool(probe()) if probe is not None else False
    except (RuntimeError, AttributeError):
        return False


def _has_bf16_instructions() -> bool:
    return (_supported("_is_avx512_bf16_supported", torch.cpu)
            or _supported("_is_amx_tile_supported", torch.cpu))


@functools.cache
def native_matmul_dtypes() -> frozenset[torch.dtype]:
    """The dtypes whose CPU matmuls run on this CPU's own instructions (float32 always)."""
    dtypes = {torch.float32}
    if torch.backends.mkldnn.is_available():
        if _supported("_is_mkldnn_bf16_supported") and _has_bf16_instructions():
            dtypes.add(torch.bfloat16)
        if _supported("_is_mkldnn_fp16_supported"):
            dtypes.add(torch.float16)
    return frozenset(dtypes)


@functools.cache
def has_amx() -> bool:
    """Whether this CPU has AMX tiles (Sapphire Rapids and later), where oneDNN's bfloat16
    matmuls run on them and outpace our VDPBF16PS kernels beyond a few rows."""
    return _supported("_is_amx_tile_supported", torch.cpu)


def default_cpu_dtype() -> str:
    """What dtype "auto" resolves to on this CPU."""
    return "bfloat16" if torch.bfloat16 in native_matmul_dtypes() else "float32"


def describe() -> str:
    """One line for logs and `splitserve profile`: the capability torch sees and native dtypes."""
    names = sorted(str(d).removeprefix("torch.") for d in native_matmul_dtypes())
    return f"{torch.backends.cpu.get_cpu_capability()}, native matmul dtypes: {', '.join(names)}"
