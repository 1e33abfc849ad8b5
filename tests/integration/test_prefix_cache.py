"""The prefix cache changes nothing but speed: float32 greedy tokens with the cache equal those
without it (default model), for whole hits, hits ending mid-block, hits that leave the rest of a
prompt to several chunks, a later turn whose history holds the model's own answer, and prompts
whose cached blocks were evicted; and the hits really happen."""

from __future__ import annotations

from pathlib import Path

from common.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from common.engine.llm_engine import LLMEngine
from common.tokenizer import TextTokenizer

TEXT = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
NEW_TOKENS = 12


def engine(prefix_caching: bool, num_blocks: int = 256) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(num_blocks=num_blocks, block_size=16, prefix_caching=prefix_caching),
        batch=BatchConfig(max_num_seqs=8, max_num_batched_tokens=64)))  # long prompts chunked


def run_turns(llm: LLMEngine, turns) -> list[list[int]]:
    """Each turn is a list of prompts, or a function of the outputs so far giving one; turns run
    one after another (so later ones can hit what earlier ones cached)."""
    outputs = []
    params = llm.default_params(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for turn in turns:
        prompts = turn(outputs) if callable(turn) else turn
        results = llm.generate(prompts, [params] * len(prompts))
        outputs += [r.token_ids[len(p):] for r, p in zip(results, prompts)]
    return outputs


def both_ways(turns, num_blocks=256):
    runs = {}
    for caching in (False, True):
        llm = engine(caching, num_blocks)
        try:
            runs[caching] = (run_turns(llm, turns), llm.kv.stats, llm.kv)
            llm.scheduler.check_integrity()
            assert llm.kv.num_free_blocks == llm.kv.num_blocks  # nothing leaked
        finally:
            llm.close()
    assert runs[True][0] == runs[False][0]
    assert runs[False][1].hits == 0
    return runs[True][1]


def prompts(default_model):
    ids = TextTokenizer(default_model.hf_dir).encode(TEXT)
    return ids[:150], ids[150:400]


def test_whole_and_mid_block_hits_give_the_same_tokens(default_model):
    a, b = prompts(default_model)
    stats = both_ways([
        [a],
        [a],  # whole prompt cached: 9 blocks (144 tokens) shared, 6 computed
        [a[:70] + b[:20]],  # shares 64 tokens; the common prefix ends mid-block (70)
        [a[:16] + [5] + a[17:]],  # one token differs in block 2: only block 1 is shared
    ])
    assert stats.hits == 144 + 64 + 16


def test_a_hit_leaves_the_rest_of_a_long_prompt_to_several_chunks(default_model):
    a, b = prompts(default_model)
    stats = both_ways([[a + b], [a + b[:100] + a[:150]]])  # 250 shared, 150 in 3 chunks of 64
    assert stats.hits == 240


def test_a_later_turn_hits_the_models_own_answer(default_model):
    a, b = prompts(default_model)
    stats = both_ways([[a[:64]], lambda outputs: [a[:64] + outputs[0] + b[:40]]])
    # 64 prompt tokens + 12 generated: the blocks holding computed KV (76 -> 4 full blocks)
    assert stats.hits == 64


def test_evicted_prefixes_are_recomputed_and_give_the_same_tokens(default_model):
    a, b = prompts(default_model)
    # 24 blocks: the second prompt's 16 blocks push out most of the first prompt's cache
    stats = both_ways([[a], [b], [a], [b[:100]]], num_blocks=24)
    assert 0 < stats.hits < 144 + 96
