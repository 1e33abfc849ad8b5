"""Greedy decoding through the engine equals transformers `generate` token for token (float32)."""

from __future__ import annotations

import pytest
import torch
from helpers import engine_greedy, hf_greedy

from common.config import CacheConfig, EngineConfig, ModelConfig

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "Les feux de la Saint-Jean",
    "1, 2, 3, 4,",
]


def test_default_model_matches_transformers(default_model):
    from common.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(default_model.hf_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    prompt_ids.append(tokenizer.encode_chat([{"role": "user", "content": "Name three colors."}]))
    ours = engine_greedy(None, prompt_ids, 32)
    theirs = hf_greedy(default_model.hf_dir, prompt_ids, 32)
    assert ours == theirs


@pytest.mark.parametrize("kind", ["llama", "qwen2", "opt"])
def test_tiny_random_models_match_transformers(tiny_models, kind):
    generator = torch.Generator().manual_seed(7)
    prompt_ids = [torch.randint(3, 49152, (n,), generator=generator).tolist()
                  for n in (1, 5, 17, 40)]
    ours = engine_greedy(tiny_models[kind], prompt_ids, 24)
    theirs = hf_greedy(tiny_models[kind], prompt_ids, 24)
    assert ours == theirs
    assert all(len(t) == 24 for t in ours), "random tiny models should not stop early"


@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_hidden_layers_match_transformers_hidden_states(tiny_models, kind):
    """`BatchPlan.hidden_layers` (the probe's input) is HF's `hidden_states` at the last prompt
    token, layer for layer, for prompts sharing one forward, one of them in two chunks."""
    from transformers import AutoModelForCausalLM

    from common.block_pool import KVCacheManager
    from common.engine.model_runner import ModelRunner
    from common.plan import BatchPlan, ScheduledChunk
    from common.sampling_params import SamplingParams

    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (4, 19, 33)]
    runner = ModelRunner(EngineConfig(model=ModelConfig(path=str(tiny_models[kind]),
                                                        dtype="float32"),
                                      cache=CacheConfig(num_blocks=64)))
    num_layers = runner.model.shape.num_layers
    layers = tuple(range(num_layers + 1))
    kv = KVCacheManager(runner.kv_layout.num_blocks, runner.kv_layout.block_size)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        # The longest prompt's first 20 tokens go first, unsampled: no hidden state for it.
        first = runner.execute(BatchPlan([ScheduledChunk("c", prompts[2][:20], 0,
                                                         kv.grow("c", 20), None)],
                                         return_hidden=True, hidden_layers=layers))
        assert first.hidden == {}
        chunks = [ScheduledChunk(f"p{i}", p, 0, kv.grow(f"p{i}", len(p)), greedy)
                  for i, p in enumerate(prompts[:2])]
        chunks.append(ScheduledChunk("c", prompts[2][20:], 20, kv.grow("c", 33), greedy))
        ours = runner.execute(BatchPlan(chunks, return_hidden=True, hidden_layers=layers)).hidden
        final_only = runner.execute(BatchPlan(
            [ScheduledChunk("q", prompts[0], 0, kv.grow("q", 4), greedy)], return_hidden=True))
    finally:
        runner.close()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models[kind]), dtype=torch.float32)
    for seq_id, prompt in zip(("p0", "p1", "c"), prompts):
        with torch.inference_mode():
            states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        expected = torch.stack([s[0, -1] for s in states])
        assert ours[seq_id].shape == (num_layers + 1, runner.model.shape.hidden_size)
        torch.testing.assert_close(ours[seq_id], expected, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(final_only.hidden["q"], ours["p0"][-1], atol=1e-5, rtol=1e-5)
