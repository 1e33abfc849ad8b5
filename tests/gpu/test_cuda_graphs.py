"""CUDA: decode steps replayed from captured graphs (common.engine.cuda_graphs) give the tokens
of the eager forward, float32, default model, with batches shrinking through the buckets as
sequences finish.

Skipped without CUDA (tests/conftest.py skips `gpu` tests). Not yet run on a GPU: no GPU was
lent to the session that wrote it.
"""

from __future__ import annotations

import pytest
import torch

from common.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from common.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

MAX_BATCH = 16


def generate(cuda_graphs: bool, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy tokens of every prompt, and how many steps replayed a graph."""
    config = EngineConfig(
        model=ModelConfig(device="cuda", dtype="float32", cuda_graphs=cuda_graphs,
                          cuda_graph_max_batch=MAX_BATCH),
        cache=CacheConfig(block_size=16, num_blocks=512), batch=BatchConfig(max_num_seqs=24))
    engine = LLMEngine(config)
    replays = 0
    graphs = engine.runner.graphs
    if graphs is not None:
        run = graphs.run

        def counted(batch):
            nonlocal replays
            replays += 1
            return run(batch)
        graphs.run = counted
    try:
        params = [engine.default_params(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True)
                  for i in range(len(prompts))]
        return [r.token_ids for r in engine.generate(prompts, params)], replays
    finally:
        engine.close()


def prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 40000, (5 + 37 * i,), generator=gen).tolist() for i in range(count)]


def test_graph_replay_gives_the_eager_tokens_float32():
    batch = prompts(20)  # 20 sequences: more than the largest bucket, then fewer as they finish
    eager, no_replays = generate(False, batch)
    replayed, replays = generate(True, batch)
    assert no_replays == 0 and replays > 10
    assert replayed == eager


def test_buckets_stop_at_the_smaller_of_the_flag_and_max_num_seqs():
    config = EngineConfig(model=ModelConfig(device="cuda", dtype="float16",
                                            cuda_graph_max_batch=256),
                          cache=CacheConfig(num_blocks=64), batch=BatchConfig(max_num_seqs=40))
    engine = LLMEngine(config)
    try:
        assert engine.runner.graphs.buckets == [1, 2, 4, 8, 16, 24, 32, 40]
    finally:
        engine.close()
