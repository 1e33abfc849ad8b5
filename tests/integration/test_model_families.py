"""Qwen3, Gemma 2, Gemma 3, Phi-3 and the llama3 / yarn rope scalings against transformers.

Each family is a tiny random checkpoint (tests/helpers.py: sliding window 16 tokens for Gemma
and Phi-3, soft-caps that bend the scores for Gemma 2, partial rotary and longrope for Phi-3).
In float32, the exact mode:
- greedy tokens through the engine (scheduler, batching) equal transformers' `generate`;
- the logits of a mixed run, prefill chunks of 7 tokens beside other sequences' decode steps,
  prompts up to 45 tokens (past the window), match transformers' forward over each whole
  sequence within 1e-4 on log_softmax, and greedy picks them;
and in bfloat16 and the default ("auto") dtype with the CPU kernels, the same run does not
crash and stays near float32.

Phi-3 sequences stay below its original context (64): past it, transformers switches a whole
sequence to longrope's long factors and this engine switches per position (models/rope.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import engine_greedy, hf_greedy, save_tiny_model

from common.block_pool import KVCacheManager
from common.config import CacheConfig, EngineConfig, ModelConfig
from common.engine import cpu_kernels
from common.engine.model_runner import ModelRunner
from common.plan import BatchPlan, ScheduledChunk
from common.sampling_params import SamplingParams

FAMILIES = ["qwen3", "gemma2", "gemma3", "phi3", "llama3", "yarn"]
VOCAB = 49152  # the default model's tokenizer, which the engine detokenizes with
CHUNK = 7


@pytest.fixture(scope="module")
def family_models(tmp_path_factory, default_model):
    root = tmp_path_factory.mktemp("families")
    return {kind: save_tiny_model(kind, root / kind, default_model.hf_dir, VOCAB)
            for kind in FAMILIES}


def random_prompts(lengths, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def make_runner(path, dtype: str = "float32") -> ModelRunner:
    return ModelRunner(EngineConfig(model=ModelConfig(path=str(path), dtype=dtype),
                                    cache=CacheConfig(num_blocks=64, block_size=16)))


def _step(runner, kv, states, greedy) -> None:
    """One forward: each unfinished sequence's next chunk (at most CHUNK prompt tokens, or its
    last sampled token)."""
    chunks = []
    for seq_id, state in states.items():
        if len(state["out"]) == state["new"]:
            continue
        start, tokens = state["computed"], state["tokens"]
        end = min(len(tokens), start + CHUNK)
        chunks.append(ScheduledChunk(seq_id, tokens[start:end], start, kv.grow(seq_id, end),
                                     greedy if end == len(tokens) else None,
                                     num_output_tokens=len(state["out"])))
        state["computed"] = end
    output = runner.execute(BatchPlan(chunks, return_logits=True))
    for seq_id, token in output.sampled_token_ids.items():
        states[seq_id]["out"].append(token)
        states[seq_id]["tokens"].append(token)
        states[seq_id]["logits"].append(output.logits[seq_id])


def mixed_run(runner, prompts, new_tokens: int) -> list[dict]:
    """Greedy continuations of all prompts in shared forwards: prompts of different lengths put
    prefill chunks and decode steps in the same batch. Per prompt: its tokens, the sampled ones
    and their logits."""
    kv = KVCacheManager(runner.kv_layout.num_blocks, runner.kv_layout.block_size)
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    states = {f"s{i}": {"tokens": list(p), "computed": 0, "out": [], "logits": [],
                        "new": new_tokens} for i, p in enumerate(prompts)}
    while any(len(s["out"]) < new_tokens for s in states.values()):
        _step(runner, kv, states, greedy)
    return list(states.values())


def hf_logits(path, sequences: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([seq])).logits[0] for seq in sequences]


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_tokens_match_transformers_generate(family_models, kind):
    prompts = random_prompts((1, 17, 33), seed=7)
    ours = engine_greedy(family_models[kind], prompts, 16)
    assert ours == hf_greedy(family_models[kind], prompts, 16)
    assert all(len(t) == 16 for t in ours), "random tiny models should not stop early"


@pytest.mark.parametrize("kind", FAMILIES)
def test_chunked_and_decode_logits_match_transformers(family_models, kind):
    prompts = random_prompts((3, 21, 45), seed=11)
    runner = make_runner(family_models[kind])
    try:
        runs = mixed_run(runner, prompts, 12)
    finally:
        runner.close()
    sequences = [run["tokens"][:-1] for run in runs]  # the last token was never fed back
    for prompt, run, reference in zip(prompts, runs, hf_logits(family_models[kind], sequences)):
        expected = reference[len(prompt) - 1:]  # the rows that predicted the sampled tokens
        ours = torch.stack(run["logits"])
        torch.testing.assert_close(ours.log_softmax(-1), expected.log_softmax(-1),
                                   atol=1e-4, rtol=0)
        assert run["out"] == expected.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "auto"])
@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_reduced_precision_and_kernel_paths_run(family_models, kind, dtype):
    prompts = random_prompts((3, 30), seed=5)
    runners = [make_runner(family_models[kind], d) for d in ("float32", dtype)]
    try:
        if cpu_kernels.load(runners[1].config.model.cache_dir) is not None:
            assert runners[1].model.ops.name == "cpu-kernels"  # not the exact mode's torch ops
        exact, fast = (mixed_run(r, prompts, 4) for r in runners)
    finally:
        for runner in runners:
            runner.close()
    for want, got in zip(exact, fast):
        first = got["logits"][0]  # later steps may follow a different (near-tied) token
        assert torch.isfinite(first).all()
        drift = (first.log_softmax(-1) - want["logits"][0].log_softmax(-1)).abs().max()
        # measured: up to 0.15 in bfloat16, 1e-5 for float32 through the kernels
        assert drift < (0.5 if runners[1].dtype_name == "bfloat16" else 1e-3)
