"""Log-probabilities and sampling controls through the engine, against transformers in float32
on a tiny random model: the top log-probabilities of generated and of prompt tokens (a prompt in
several prefill chunks) equal log_softmax of transformers' logits; penalties and logit_bias
change greedy output exactly as the same processing on transformers' logits does; min_tokens
holds off a likely EOS; a request asking for prompt log-probabilities takes no cached prefix."""

from __future__ import annotations

import math

import pytest
import torch

from common.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from common.engine.llm_engine import LLMEngine

VOCAB = 49152
TOP = 5
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


def load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_hf(model_dir)


@pytest.fixture(scope="module")
def hf_default(default_model):
    """The default model: a real one repeats itself, so the penalties have work to do (the
    random tiny ones never pick a token twice)."""
    return load_hf(default_model.hf_dir)


def make_engine(model_dir, prefix_caching=False, chunk=16) -> LLMEngine:
    """`model_dir` None: the default model."""
    return LLMEngine(EngineConfig(
        model=ModelConfig(path=str(model_dir) if model_dir else None, dtype="float32"),
        cache=CacheConfig(num_blocks=256, block_size=16, prefix_caching=prefix_caching),
        batch=BatchConfig(max_num_seqs=16, max_num_batched_tokens=chunk)))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row j is transformers' log-distribution of token j + 1."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches(entry, expected: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(expected[token].item(), abs=TOLERANCE)
    assert entry.rank == 1 + int((expected > expected[token]).sum())
    top = expected.topk(k)
    assert entry.top_ids == top.indices.tolist()
    assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=TOLERANCE)


def test_logprobs_of_generated_and_prompt_tokens_match_transformers(model_dir, hf_model):
    """Three prompts in one batch, the long one over three 16-token chunks; one asks for
    nothing, one for sampled log-probabilities alone, with temperature and processing that
    change what is sampled but not the log-probabilities (the model's raw distribution)."""
    prompts = [prompt(40, 1), prompt(7, 2), prompt(12, 3)]
    engine = make_engine(model_dir)
    try:
        params = [engine.default_params(max_tokens=6, temperature=0.0, ignore_eos=True,
                                        logprobs=TOP, prompt_logprobs=TOP),
                  engine.default_params(max_tokens=6, temperature=0.0, ignore_eos=True),
                  engine.default_params(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True,
                                        logprobs=0, repetition_penalty=1.5,
                                        logit_bias=((9, 3.0),))]
        results = engine.generate(prompts, params)
    finally:
        engine.close()
    full, plain, sampled = results
    assert not plain.logprobs and not plain.prompt_logprobs and not sampled.prompt_logprobs
    for result, k in ((full, TOP), (sampled, 0)):
        expected = hf_logprobs(hf_model, result.prompt_token_ids + result.token_ids)
        num_prompt = len(result.prompt_token_ids)
        assert len(result.logprobs) == len(result.token_ids) == 6
        for i, entry in enumerate(result.logprobs):
            assert_matches(entry, expected[num_prompt - 1 + i], result.token_ids[i], k)
    assert len(full.prompt_logprobs) == len(prompts[0]) - 1
    expected = hf_logprobs(hf_model, prompts[0])
    for j, entry in enumerate(full.prompt_logprobs):
        assert_matches(entry, expected[j], prompts[0][j + 1], TOP)
    assert all(e.rank == 1 for e in full.logprobs)  # greedy takes the likeliest


def processed(logits: torch.Tensor, prompt_ids: list[int], output: list[int], repetition=1.0,
              frequency=0.0, presence=0.0, bias=()) -> torch.Tensor:
    """One step's processing done by hand, token by token, on a copy of `logits`."""
    logits = logits.clone()
    for token, value in bias:
        logits[token] += value
    for token in set(prompt_ids) | set(output):
        value = logits[token]
        logits[token] = value / repetition if value > 0 else value * repetition
    for token in set(output):
        logits[token] -= frequency * output.count(token) + presence
    return logits


def assert_reference_greedy(hf_model, prompt_ids: list[int], output: list[int], **control):
    """`output` is what greedy decoding with the control gives on transformers' logits: at
    every step, the argmax of the processed logits is the next token (so, by induction, the
    whole output is the reference's; one teacher-forced forward instead of one per token)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + output])).logits[0].float()
    for i, token in enumerate(output):
        step = processed(logits[len(prompt_ids) - 1 + i], prompt_ids, output[:i], **control)
        assert int(step.argmax()) == token, f"step {i}"


REPETITIVE = ["1, 2, 3, 4, 5, 6, 7,", "The cat sat on the mat. The cat sat on the"]
CONTROLS = {
    "repetition_penalty": 1.8,
    "frequency_penalty": 2.0,
    "presence_penalty": 1.5,
    "logit_bias": ((100, 30.0), (200, 25.0)),
}
REFERENCE_ARGS = {"repetition_penalty": "repetition", "frequency_penalty": "frequency",
                  "presence_penalty": "presence", "logit_bias": "bias"}
STEPS = 12


def test_controls_change_greedy_output_as_the_reference_predicts(hf_default):
    """Each control on two prompts of the default model, all in one batch with the same
    prompts uncontrolled (which must come out as plain greedy decoding does)."""
    engine = make_engine(None, chunk=512)
    try:
        prompts = [engine.tokenizer.encode(text) for text in REPETITIVE]
        greedy = {"max_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}
        params = [engine.default_params(**greedy, **{name: value})
                  for name, value in CONTROLS.items() for _ in prompts]
        params += [engine.default_params(**greedy)] * len(prompts)
        results = engine.generate(prompts * (len(CONTROLS) + 1), params)
    finally:
        engine.close()
    plain = [r.token_ids for r in results[-len(prompts):]]
    for p, output in zip(prompts, plain):
        assert_reference_greedy(hf_default, p, output)
    for index, (name, value) in enumerate(CONTROLS.items()):
        ours = [r.token_ids for r in results[index * len(prompts):][:len(prompts)]]
        for p, output in zip(prompts, ours):
            assert_reference_greedy(hf_default, p, output, **{REFERENCE_ARGS[name]: value})
        assert ours != plain, f"{name} should change this model's greedy output"


def test_min_tokens_holds_off_a_likely_eos(model_dir):
    engine = make_engine(model_dir)
    try:
        eos = engine.tokenizer.eos_token_ids[0]
        forced = {"max_tokens": 10, "temperature": 0.0, "logit_bias": ((eos, 100.0),)}
        results = engine.generate([prompt(8, 6)] * 2,
                                  [engine.default_params(**forced),
                                   engine.default_params(min_tokens=4, **forced)])
    finally:
        engine.close()
    assert results[0].token_ids == [eos] and results[0].finish_reason == "stop"
    assert len(results[1].token_ids) == 5 and results[1].finish_reason == "stop"
    assert eos not in results[1].token_ids[:4] and results[1].token_ids[4] == eos


def test_prompt_logprobs_take_no_cached_prefix(model_dir, hf_model):
    shared = prompt(48, 7)
    engine = make_engine(model_dir, prefix_caching=True, chunk=64)
    try:
        greedy = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
        engine.generate([shared], [engine.default_params(**greedy)])  # caches the prompt
        hits = engine.kv.stats.hits
        asking = engine.generate([shared], [engine.default_params(prompt_logprobs=1, **greedy)])
        assert engine.kv.stats.hits == hits, "a prompt_logprobs request claimed cached blocks"
        engine.generate([shared], [engine.default_params(**greedy)])
        assert engine.kv.stats.hits > hits  # the same prompt without them does hit
    finally:
        engine.close()
    expected = hf_logprobs(hf_model, shared)
    entries = asking[0].prompt_logprobs
    assert len(entries) == len(shared) - 1
    for j, entry in enumerate(entries):
        assert_matches(entry, expected[j], shared[j + 1], 1)
    assert math.isfinite(entries[0].logprob)
