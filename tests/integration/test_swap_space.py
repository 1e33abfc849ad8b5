"""The host swap tier on a real (tiny) model: KV swapped out and back continues identically."""

from __future__ import annotations

import time

import pytest
import torch

from common.block_pool import KVCacheManager
from common.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from common.engine.model_runner import ModelRunner
from common.engine.swap import HostSwapSpace
from common.plan import BatchPlan, ScheduledChunk
from common.sampling_params import SamplingParams
from common.schedulers.coupled import make_coupled_scheduler
from common.schedulers.swapping import SwapSpace
from common.sequence import Sequence

GREEDY = SamplingParams(max_tokens=1000, temperature=0.0)


@pytest.fixture(scope="module")
def runner(tiny_models):
    config = EngineConfig(model=ModelConfig(path=str(tiny_models["llama"]), dtype="float32"),
                          cache=CacheConfig(num_blocks=64, block_size=16))
    r = ModelRunner(config)
    r.swap_space = HostSwapSpace(r.kv_layout, num_host_blocks=16)
    yield r
    r.close()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(runner, kv, seq, steps, before_decode=None):
    """Greedy tokens of `seq` (prefill, then `steps` decodes); `before_decode(i)` returns plans
    to run before decode i (swaps, other sequences' chunks)."""
    tokens = []
    while len(tokens) < steps:
        for plan in before_decode(len(tokens)) if before_decode else []:
            runner.execute(plan)
        start = seq.num_computed_tokens
        blocks = kv.grow(seq.seq_id, seq.num_tokens)
        chunk = ScheduledChunk(seq.seq_id, seq.token_ids[start:], start, list(blocks),
                               GREEDY, seq.num_output_tokens)
        token = runner.execute(BatchPlan([chunk])).sampled_token_ids[seq.seq_id]
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(token)
        tokens.append(token)
    return tokens


def test_swapped_out_and_back_sequence_continues_with_the_same_tokens(runner):
    layout = runner.kv_layout
    prompt = _prompt(40, 1)
    kv = KVCacheManager(layout.num_blocks, layout.block_size)
    reference = _generate(runner, kv, Sequence("ref", prompt, GREEDY, 512), 12)

    # 8 blocks: the sequence takes 0-2, the intruder (7 blocks) must reuse what it frees
    kv = KVCacheManager(8, layout.block_size)
    swap = SwapSpace(runner.swap_space.num_blocks)
    seq = Sequence("s", prompt, GREEDY, 512)
    intruder = Sequence("intruder", _prompt(100, 2), GREEDY, 512)

    def swap_out_and_back(i):
        if i != 5:
            return []
        # out, while a second sequence takes the freed blocks and overwrites them
        pairs = swap.swap_out(seq, kv)
        table = kv.grow("intruder", intruder.num_tokens)
        assert set(table) & {d for d, _ in pairs}, "the freed blocks must be reused"
        overwrite = BatchPlan([ScheduledChunk("intruder", intruder.token_ids, 0, table)],
                              swap_out=pairs)
        kv.free("intruder")
        kv.grow("pad", 3 * layout.block_size)  # so the sequence comes back to other blocks
        back = BatchPlan([], swap_in=swap.swap_in(seq, kv))  # a plan of swaps alone
        assert [d for _, d in back.swap_in] != [d for d, _ in pairs]
        return [overwrite, back]

    assert _generate(runner, kv, seq, 12, swap_out_and_back) == reference
    assert runner.swap_space.stats.num_blocks_out == runner.swap_space.stats.num_blocks_in == 3


def test_emulated_bandwidth_is_honoured(runner):
    layout = runner.kv_layout
    num_blocks = 8
    seconds = 0.2
    space = HostSwapSpace(layout, 16, bandwidth_bytes_per_s=num_blocks * layout.bytes_per_block
                          / seconds)
    started = time.perf_counter()
    took = space.execute(runner.kv_cache, [(b, b) for b in range(num_blocks)], [])
    assert time.perf_counter() - started >= seconds * 0.99 and took >= seconds * 0.99
    assert space.stats.wait_seconds > 0 and space.stats.num_blocks_out == num_blocks
    fast = HostSwapSpace(layout, 16)
    assert fast.execute(runner.kv_cache, [(b, b) for b in range(num_blocks)], []) < seconds / 4


@pytest.mark.parametrize("policy", ["sarathi", "fastserve", "decode-maximal"])
def test_a_policy_that_swaps_generates_what_an_unconstrained_one_does(runner, policy):
    """Four prompts through a scheduler whose pool is too small: preemption by swap (FastServe:
    also its proactive swaps, on by default with the reserve rule) and by recompute (no host
    tier) must not change a single greedy token."""
    prompts = [_prompt(n, 10 + n) for n in (20, 33, 17, 40)]

    def run(num_blocks, host_blocks):
        runner.swap_space = HostSwapSpace(runner.kv_layout, host_blocks) if host_blocks else None
        sched = make_coupled_scheduler(policy, BatchConfig(max_num_seqs=4,
                                                           max_num_batched_tokens=64),
                                       KVCacheManager(num_blocks, runner.kv_layout.block_size),
                                       SwapSpace(host_blocks) if host_blocks else None)
        for i, prompt in enumerate(prompts):
            sched.add(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=30, temperature=0.0),
                               512))
        out = {}
        while sched.has_work:
            plan = sched.schedule()
            assert not plan.is_empty
            for update in sched.update_from_output(plan, runner.execute(plan)):
                out.setdefault(update.seq_id, []).extend(update.new_token_ids)
        return out, sched

    ample, _ = run(64, 16)
    tight, sched = run(7, 16)
    assert sched.num_preemptions > 0 and sched.swap.num_swap_ins > 0
    assert tight == ample
    recomputed, sched = run(7, 0)
    assert sched.num_preemptions > 0 and recomputed == ample
    runner.swap_space = HostSwapSpace(runner.kv_layout, num_host_blocks=16)
