"""GGUF to Hugging Face directory conversion.

A GGUF file is converted once into an ordinary Hugging Face directory (config.json,
model.safetensors in float32, tokenizer files) under the cache directory; every later load reads
that directory, which takes seconds. Quantized tensors (Q4_1, Q8_0, ...) are dequantized with the
`gguf` package; llama.cpp's rotary permutation of the query and key projections is undone so the
result is the checkpoint transformers itself would load.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from common.errors import ModelLoadError

# GGUF architectures we convert, with the HF architecture they become and whether llama.cpp
# permuted the query/key rows for its rotary layout.
_ARCHES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
}

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k rows (interleaved -> half-split rotary layout)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    return None


def _hf_config(reader, arch: str, has_output: bool) -> dict:
    hf_arch, model_type, _ = _ARCHES[arch]
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // num_heads)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": not has_output,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
        value = _field(reader, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[key] = int(value)
    return config


def _convert_tensors(reader, arch: str, config: dict) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    permuted = _ARCHES[arch][2]
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue  # e.g. rope_freqs: derived from the config instead
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        if permuted and name.endswith("q_proj.weight"):
            array = _unpermute(array, config["num_attention_heads"])
        elif permuted and name.endswith("k_proj.weight"):
            array = _unpermute(array, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(array)
    return tensors


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    # transformers owns the GGUF vocabulary -> tokenizers conversion; we only save its result.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face directory for `gguf_path` at `out_dir` (atomically)."""
    import gguf
    from safetensors.numpy import save_file

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as exc:  # the gguf package raises bare ValueError/struct errors
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {exc}") from None
    arch = str(_field(reader, "general.architecture", "?"))
    if arch not in _ARCHES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r} in {gguf_path}; supported: {sorted(_ARCHES)}")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = _hf_config(reader, arch, has_output)
    tmp_dir = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    try:
        tensors = _convert_tensors(reader, arch, config)
        save_file(tensors, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        (tmp_dir / "config.json").write_text(json.dumps(config, indent=2))
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        (tmp_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
        _save_tokenizer(gguf_path, tmp_dir)
        os.replace(tmp_dir, out_dir)
    except ModelLoadError:
        raise
    except Exception as exc:  # damaged tensors or vocabulary deep inside gguf/transformers
        raise ModelLoadError(f"cannot convert GGUF file {gguf_path}: "
                             f"{type(exc).__name__}: {exc}") from None
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


if __name__ == "__main__":  # run by model_files in a child process: python -m common.gguf_convert
    import sys

    try:
        convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
    except ModelLoadError as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
