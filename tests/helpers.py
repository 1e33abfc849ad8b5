"""Shared test helpers: tiny random-weight models saved as Hugging Face directories, the CLI."""

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


# Small enough to run in seconds, shaped so every feature bites: grouped-query heads, a head_dim
# that is not hidden / heads (Qwen3, Gemma), a sliding window shorter than the test prompts
# (Gemma, Phi-3), soft-caps small enough for tanh to bend the scores (Gemma 2), rope scalings
# whose low/high frequency regimes both occur (llama3, yarn, longrope, linear on Gemma 3's global
# layers), partial rotary (Phi-3).
_COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 512, "bos_token_id": 1,
           "eos_token_id": 2, "pad_token_id": 0}
TINY_WINDOW = 16
PHI3_ORIGINAL_CONTEXT = 64  # longrope's short factors apply below it


def _tiny_config(kind: str, vocab_size: int):
    import transformers

    common = dict(_COMMON, vocab_size=vocab_size)
    if kind in ("llama", "llama3", "yarn"):
        scaling = {"llama": None,
                   "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                   "yarn": {"rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 64}}[kind]
        return transformers.LlamaConfig(num_hidden_layers=2, rms_norm_eps=1e-5,
                                        tie_word_embeddings=False, rope_scaling=scaling, **common)
    if kind == "qwen2":
        return transformers.Qwen2Config(num_hidden_layers=2, tie_word_embeddings=True, **common)
    if kind == "qwen3":
        return transformers.Qwen3Config(num_hidden_layers=2, head_dim=32,
                                        tie_word_embeddings=False, **common)
    if kind == "gemma2":
        return transformers.Gemma2Config(
            num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, rope_theta=2e4,
            sliding_window=TINY_WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
            **common)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=32,
            sliding_window=TINY_WINDOW, sliding_window_pattern=3, rope_theta=2e5,
            rope_local_base_freq=5e3, rope_scaling={"rope_type": "linear", "factor": 2.0},
            **common)
    if kind == "phi3":
        scaling = {"rope_type": "longrope", "short_factor": [1.0, 1.3, 2.1, 3.0],
                   "long_factor": [1.5, 2.5, 4.0, 8.0]}
        return transformers.Phi3Config(
            num_hidden_layers=2, partial_rotary_factor=0.5, rope_scaling=scaling,
            original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT, sliding_window=TINY_WINDOW,
            tie_word_embeddings=False, **dict(common, max_position_embeddings=256))
    raise ValueError(kind)


def tiny_hf_model(kind: str, vocab_size: int, seed: int = 0):
    """A random-weight transformers model of `kind` (float32), weights scaled as below."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if kind == "opt":
        config = transformers.OPTConfig(
            vocab_size=vocab_size, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    else:
        config = _tiny_config(kind, vocab_size)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Random init gives near-uniform logits; scale them up so greedy choices are clear-cut.
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(8.0 if param.dim() > 1 else 1.0)
            if param.dim() == 1 and kind not in ("llama", "qwen2", "opt"):
                param.add_(torch.randn_like(param) * 0.1)  # norms off their init (0 or 1)
    return model.eval()


def save_tiny_model(kind: str, out_dir: Path, tokenizer_dir: Path | None, vocab_size: int,
                    seed: int = 0, max_shard_size: str | None = None) -> Path:
    """A small random-weight checkpoint (float32 safetensors, sharded with `max_shard_size`) in
    `out_dir`: llama, qwen2, opt; qwen3, gemma2, gemma3, phi3; llama3 and yarn (Llama with
    that rope scaling)."""
    model = tiny_hf_model(kind, vocab_size, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out_dir), safe_serialization=True, **extra)
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def hf_greedy(hf_dir, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate` (float32) continuation of each prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    outputs = []
    for ids in prompt_ids:
        tensor = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(tensor, attention_mask=torch.ones_like(tensor),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=model.config.eos_token_id)
        outputs.append(out[0, len(ids):].tolist())
    return outputs


def engine_greedy(path, prompt_ids, max_new_tokens, **batch):
    """Our engine's greedy continuation of each prompt (float32, the exact mode)."""
    from common.config import CacheConfig, EngineConfig, ModelConfig
    from common.engine.llm_engine import LLMEngine

    config = EngineConfig(model=ModelConfig(path=str(path) if path else None, dtype="float32"),
                          cache=CacheConfig(num_blocks=512))
    engine = LLMEngine(config)
    try:
        params = engine.default_params(max_tokens=max_new_tokens, temperature=0.0)
        return [r.token_ids for r in engine.generate(prompt_ids, [params] * len(prompt_ids))]
    finally:
        engine.close()


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
