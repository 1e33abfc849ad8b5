"""Shared builders for the coupled-policy tests: schedulers, sequences, plan shapes, a fake KV.

`FakeKV` stands in for the runner: it keeps the token id each block slot holds, applies a plan's
swaps (swap-outs first, as the runner does) and checks that every chunk's cached prefix is really
in the blocks the chunk names, so block ownership bugs (a block reused while still needed, a
swap copied in the wrong order) fail a test without a model.
"""

from __future__ import annotations

from common.block_pool import KVCacheManager
from common.config import BatchConfig
from common.plan import BatchPlan, ModelOutput
from common.sampling_params import SamplingParams
from common.schedulers.coupled import make_coupled_scheduler
from common.schedulers.swapping import SwapSpace
from common.sequence import Sequence


def make(policy, budget=8, max_seqs=4, num_blocks=32, block_size=4, host_blocks=0,
         options=None):
    swap = SwapSpace(host_blocks) if host_blocks else None
    return make_coupled_scheduler(policy, BatchConfig(max_num_seqs=max_seqs,
                                                      max_num_batched_tokens=budget),
                                  KVCacheManager(num_blocks, block_size), swap, options)


def seq(seq_id, prompt_len, max_tokens=4, first=1):
    return Sequence(seq_id, list(range(first, first + prompt_len)),
                    SamplingParams(max_tokens=max_tokens), max_model_len=1000, arrival_time=0.0)


def shape(plan):
    return [(c.seq_id, c.num_cached, c.num_tokens, c.sampling is not None) for c in plan.chunks]


def step(sched, plan, token=7):
    out = ModelOutput({c.seq_id: token for c in plan.chunks if c.sampling is not None})
    return sched.update_from_output(plan, out)


class FakeKV:
    """Token ids per block slot, on the device and on the host."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}

    def execute(self, plan: BatchPlan, sched) -> ModelOutput:
        for device_block, host_block in plan.swap_out:
            self.host[host_block] = list(self.device[device_block])
        for host_block, device_block in plan.swap_in:
            self.device[device_block] = list(self.host[host_block])
        sampled = {}
        for chunk in plan.chunks:
            tokens = sched.sequences[chunk.seq_id].token_ids
            for pos in range(chunk.num_cached):  # the cached prefix must be where it is claimed
                block = chunk.block_ids[pos // self.block_size]
                assert self.device[block][pos % self.block_size] == tokens[pos], \
                    f"{chunk.seq_id}: KV of token {pos} is not in block {block}"
            for offset, token in enumerate(chunk.token_ids):
                pos = chunk.num_cached + offset
                slots = self.device.setdefault(chunk.block_ids[pos // self.block_size],
                                               [None] * self.block_size)
                slots[pos % self.block_size] = token
            if chunk.sampling is not None:
                sampled[chunk.seq_id] = 1000 + chunk.num_cached + chunk.num_tokens
        return ModelOutput(sampled)


def add_random(sched, rng, count: int, max_prompt: int, max_tokens: int, spacing: int,
               min_tokens: int = 2) -> dict:
    """`count` sequences of random prompt and output lengths, arriving `spacing` apart; returns
    {seq_id: its max_tokens}, what run_to_completion must finish with."""
    wanted = {}
    for i in range(count):
        s = seq(f"s{i}", rng.randint(2, max_prompt),
                max_tokens=rng.randint(min_tokens, max_tokens),
                first=spacing * i + 1)
        wanted[s.seq_id] = s.sampling.max_tokens
        sched.add(s)
    return wanted


def run_to_completion(sched, max_steps=2000):
    """Drive the scheduler with a FakeKV until it has no work, checking integrity every step.
    Returns the plans it made and {seq_id: output tokens} of the finished sequences."""
    fake = FakeKV(sched.kv.block_size)
    plans, finished = [], {}
    while sched.has_work:
        plan = sched.schedule()
        assert not plan.is_empty, f"work left but an empty plan: {sched.sequences}"
        plans.append(plan)
        for update in sched.update_from_output(plan, fake.execute(plan, sched)):
            if update.finish_reason is not None:
                finished[update.seq_id] = update.num_output_tokens
        sched.check_integrity()
        assert len(plans) < max_steps, "no progress"
    return plans, finished
