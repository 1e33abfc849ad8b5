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
