"""What "auto" means on a CPU with and without native bfloat16 matmuls (no model needed)."""

import torch

from common.config import ModelConfig
from common.engine import cpu_features
from common.engine.models import layers


def test_auto_follows_the_cpu_default_and_explicit_dtypes_win():
    assert ModelConfig().resolved_dtype("float32") == "float32"
    assert ModelConfig().resolved_dtype("bfloat16") == "bfloat16"
    assert ModelConfig(dtype="bfloat16").resolved_dtype("float32") == "bfloat16"
    assert ModelConfig(dtype="auto", device="cuda").resolved_dtype("float32") == "float16"


def test_default_is_bfloat16_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(cpu_features, "native_matmul_dtypes",
                        lambda: frozenset({torch.float32}))
    assert cpu_features.default_cpu_dtype() == "float32"
    monkeypatch.setattr(cpu_features, "native_matmul_dtypes",
                        lambda: frozenset({torch.float32, torch.bfloat16}))
    assert cpu_features.default_cpu_dtype() == "bfloat16"


def test_weights_are_not_packed_in_a_dtype_the_cpu_lacks(monkeypatch):
    # oneDNN raises on packing bfloat16 without AVX512-BF16/AVX512BW: the check must say no first.
    monkeypatch.setattr(layers, "native_matmul_dtypes", lambda: frozenset({torch.float32}))
    assert not layers.can_pack(torch.bfloat16, torch.device("cpu"))
    assert not layers.can_pack(torch.float16, torch.device("cpu"))


def test_this_cpu_report_is_consistent():
    native = cpu_features.native_matmul_dtypes()
    assert torch.float32 in native
    assert (cpu_features.default_cpu_dtype() == "bfloat16") == (torch.bfloat16 in native)
    assert torch.backends.cpu.get_cpu_capability() in cpu_features.describe()


def test_bfloat16_is_not_native_where_onednn_would_emulate_it(monkeypatch):
    """oneDNN reports bfloat16 support on any AVX-512 CPU; without AVX512-BF16 or AMX it
    converts in software (3.7x slower than float32 on such a Xeon), so "auto" must say float32."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True,
                        raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False,
                        raising=False)
    for avx512_bf16, amx, native in ((False, False, False), (True, False, True),
                                     (False, True, True)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v,
                            raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        cpu_features.native_matmul_dtypes.cache_clear()
        try:
            assert (torch.bfloat16 in cpu_features.native_matmul_dtypes()) == native
        finally:
            cpu_features.native_matmul_dtypes.cache_clear()
