"""Rotary tables (common.engine.models.rope) against transformers' rope initializers, for every
scaling we support, and the config spellings they are read from."""

from __future__ import annotations

import pytest
import torch

from common.engine.models.rope import RotaryEmbedding, rope_config
from common.errors import ModelLoadError

transformers = pytest.importorskip("transformers")

HEAD_DIM, POSITIONS = 32, 300
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 128,
                 "short_factor": [1.0 + i / 16 for i in range(HEAD_DIM // 2)],
                 "long_factor": [2.0 + i / 2 for i in range(HEAD_DIM // 2)]},
}


def hf_cos(config, positions: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    init = ROPE_INIT_FUNCTIONS.get(config.rope_parameters["rope_type"],
                                   Phi3RotaryEmbedding.compute_default_rope_parameters)
    inv_freq, factor = init(config, "cpu", seq_len=seq_len)
    return (positions.float()[:, None] * inv_freq[None, :]).cos() * factor


def llama_config(scaling: dict | None, partial: float = 1.0):
    # transformers validates longrope factors and reads partial_rotary_factor in Phi-3's config
    cls = transformers.Phi3Config if not scaling or scaling["rope_type"] == "longrope" else \
        transformers.LlamaConfig
    extra = {"partial_rotary_factor": partial} if partial != 1.0 else {}
    return cls(hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=512, rope_scaling=scaling, **extra)


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_tables_equal_transformers(kind):
    config = llama_config(dict(SCALINGS[kind]))
    theta, scaling = rope_config(config.to_dict())
    rope = RotaryEmbedding(HEAD_DIM, POSITIONS, theta, scaling)
    positions = torch.arange(POSITIONS)
    if kind == "longrope":  # short factors below the original context, long ones from it
        short = positions < 128
        torch.testing.assert_close(rope.cos[short], hf_cos(config, positions[short]))
        torch.testing.assert_close(rope.cos[~short], hf_cos(config, positions[~short], 129))
    else:
        torch.testing.assert_close(rope.cos, hf_cos(config, positions))


def test_partial_rotary_rotates_the_leading_dimensions_only():
    config = llama_config(None, partial=0.5)
    rope = RotaryEmbedding(HEAD_DIM, 16, 10000.0, None, rotary_dim=16)
    torch.testing.assert_close(rope.cos, hf_cos(config, torch.arange(16))[:, :8])
    x = torch.randn(16, 2, HEAD_DIM)
    out = rope.apply(x, *rope.table(torch.arange(16), x.dtype))
    assert torch.equal(out[..., 16:], x[..., 16:])


def test_config_spellings():
    assert rope_config({"rope_theta": 5e5}) == (5e5, None)
    legacy = {"rope_theta": 1e4, "max_position_embeddings": 512,
              "original_max_position_embeddings": 128,
              "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}}
    _, scaling = rope_config(legacy, aliases={"su": "longrope"})
    assert scaling["rope_type"] == "longrope" and scaling["factor"] == 4.0
    assert scaling["original_max_position_embeddings"] == 128
    nested = {"rope_parameters": {"rope_type": "default", "rope_theta": 3.0}}
    assert rope_config(nested) == (3.0, None)
    with pytest.raises(ModelLoadError, match="dynamic"):
        RotaryEmbedding(8, 4, 1e4, {"rope_type": "dynamic", "factor": 2.0})
