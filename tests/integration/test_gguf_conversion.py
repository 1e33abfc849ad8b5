"""Our GGUF conversion yields the same tensors transformers' own GGUF loader does."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file


def test_converted_weights_equal_transformers_gguf_loader(default_model):
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF
    from transformers import AutoModelForCausalLM

    gguf = default_model.source
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32).state_dict()
    ours = load_file(str(default_model.hf_dir / "model.safetensors"))
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    assert set(ours) | {"lm_head.weight"} >= {k for k in reference if "rotary" not in k}
