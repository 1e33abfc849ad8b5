"""transformers `generate` as the baseline for decode throughput (same weights, dtype, threads).

Decode time is isolated as generate(1 + N new tokens) minus generate(1 new token) on the same
prompts, so the prompt's prefill is not counted against either side.
"""

from __future__ import annotations

import time

import torch

from common.engine.model_runner import ModelRunner

HF_BATCHES = (1, 32)
NEW_TOKENS = 32


def load_hf_model(runner: ModelRunner):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(runner.resolved.hf_dir), dtype=runner.model.embed_tokens.weight.dtype)
    return model.eval()


def _generate_seconds(model, input_ids: torch.Tensor, new_tokens: int) -> float:
    mask = torch.ones_like(input_ids)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=model.config.eos_token_id)
    return time.perf_counter() - start


def hf_decode_tokens_per_s(model, batch: int, context: int, vocab: int) -> float:
    input_ids = torch.randint(100, vocab - 100, (batch, context))
    _generate_seconds(model, input_ids, 2)  # warm-up
    prefill_only = min(_generate_seconds(model, input_ids, 1) for _ in range(2))
    full = _generate_seconds(model, input_ids, 1 + NEW_TOKENS)
    return batch * NEW_TOKENS / max(full - prefill_only, 1e-9)


def compare_decode(runner: ModelRunner, ours: list[dict], context: int, progress) -> dict:
    model = load_hf_model(runner)
    vocab = runner.model.shape.vocab_size
    hf = {}
    for batch in HF_BATCHES:
        hf[batch] = hf_decode_tokens_per_s(model, batch, context, vocab)
        progress(f"transformers generate batch {batch}: {hf[batch]:.1f} tok/s")
    ours_by_batch = {r["batch"]: r["tokens_per_s"] for r in ours}
    ratios = [{"ours_batch": ob, "hf_batch": hb, "speedup": ours_by_batch[ob] / hf[hb]}
              for ob, hb in ((32, 1), (32, 32), (1, 1)) if ob in ours_by_batch]
    return {"new_tokens": NEW_TOKENS, "tokens_per_s": hf, "ratios": ratios}
