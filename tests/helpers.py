"""Shared test helpers: tiny random-weight models saved as Hugging Face directories."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def save_tiny_model(kind: str, out_dir: Path, tokenizer_dir: Path | None, vocab_size: int,
                    seed: int = 0) -> Path:
    """A small random-weight Llama/Qwen2/OPT checkpoint (float32 safetensors) in `out_dir`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "opt":
        config = transformers.OPTConfig(
            vocab_size=vocab_size, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = transformers.OPTForCausalLM(config)
    else:
        raise ValueError(kind)
    # Random init gives near-uniform logits; scale them up so greedy choices are clear-cut.
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(8.0 if param.dim() > 1 else 1.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "control_plane.cli", *args],
                          capture_output=True, text=True, timeout=timeout,
                          cwd=Path(__file__).resolve().parents[1])


def assert_one_line_error(result, pattern: str):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert pattern in lines[0], lines[0]
