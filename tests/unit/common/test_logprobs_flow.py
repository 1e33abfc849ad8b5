"""Log-probabilities and logits-processing inputs through the schedulers and roles, with a fake
forward: what chunks carry (history, prompt_logprobs), no cached prefix for a request owing
prompt log-probabilities, prompt log-probabilities gathered over chunks and sent with the first
token, one log-probability per token after it, and the TokenUpdate on the wire."""

from __future__ import annotations

import time

import msgspec

from common.block_pool import KVCacheManager
from common.config import BatchConfig, PrefillConfig
from common.engine.logprobs import prompt_rows
from common.plan import BatchPlan, ModelOutput
from common.protocol import GenerateRequest, TokenBatch, TokenLogprobs, decode, encode
from common.sampling_params import SamplingParams
from common.schedulers.coupled import StallFreeScheduler
from common.sequence import Sequence
from prefill_instance.scheduler import PrefillScheduler

BS = 4
TOKEN = 7


def fake_forward(plan: BatchPlan) -> ModelOutput:
    """Samples TOKEN; a log-probability entry names the token it is for (the prompt's next
    token, found as the runner finds it), with logprob -position so that order shows."""
    output = ModelOutput()
    for chunk in plan.chunks:
        if chunk.prompt_logprobs is not None:
            _, targets = prompt_rows(0, chunk)
            output.prompt_logprobs[chunk.seq_id] = [
                TokenLogprobs(t, -float(chunk.num_cached + i), 1) for i, t in enumerate(targets)]
        if chunk.sampling is not None:
            output.sampled_token_ids[chunk.seq_id] = TOKEN
            if chunk.sampling.logprobs is not None:
                output.logprobs[chunk.seq_id] = TokenLogprobs(TOKEN, -0.25, 3, [1], [-0.1])
    return output


def run(sched, steps: int = 50) -> tuple[list, list[BatchPlan]]:
    updates, plans = [], []
    for _ in range(steps):
        plan = sched.schedule()
        if plan.is_empty:
            break
        plans.append(plan)
        updates += sched.update_from_output(plan, fake_forward(plan))
    return updates, plans


def stall_free(prefix_caching=False, budget=8) -> StallFreeScheduler:
    kv = KVCacheManager(64, BS, prefix_caching=prefix_caching)
    return StallFreeScheduler(BatchConfig(max_num_seqs=4, max_num_batched_tokens=budget), kv)


def test_chunks_carry_history_only_for_penalties_and_prompt_logprobs():
    sched = stall_free(budget=64)
    penalized = Sequence("pen", [1, 2, 3], SamplingParams(max_tokens=2, presence_penalty=1), 64)
    sched.add(Sequence("plain", [1, 2, 3], SamplingParams(max_tokens=2), 64))
    sched.add(penalized)
    sched.add(Sequence("lp", [1, 2, 3], SamplingParams(max_tokens=2, prompt_logprobs=0), 64))
    _, plans = run(sched)
    first = {c.seq_id: c for c in plans[0].chunks}
    assert first["plain"].history is None and first["plain"].prompt_logprobs is None
    assert first["pen"].history is penalized.token_ids  # shared, not copied
    assert first["pen"].num_prompt_tokens == 3
    assert first["lp"].history is not None and first["lp"].prompt_logprobs == 0
    decode = {c.seq_id: c for c in plans[1].chunks}
    assert decode["pen"].history is penalized.token_ids
    assert decode["lp"].history is None and decode["lp"].prompt_logprobs is None


def test_prompt_logprobs_gather_over_chunks_and_go_with_the_first_token():
    sched = stall_free(budget=8)
    prompt = list(range(100, 120))  # 20 tokens: chunks of 8, 8, 4
    params = SamplingParams(max_tokens=3, logprobs=1, prompt_logprobs=2)
    sched.add(Sequence("s", prompt, params, 64))
    updates, plans = run(sched)
    assert [c.prompt_logprobs for p in plans[:3] for c in p.chunks] == [2, 2, 2]
    first, *rest = updates
    assert [e.token_id for e in first.prompt_logprobs] == prompt[1:]
    assert [e.logprob for e in first.prompt_logprobs] == [-float(j) for j in range(19)]
    assert len(updates) == 3 and all(not u.prompt_logprobs for u in rest)
    assert all(u.logprobs == [TokenLogprobs(TOKEN, -0.25, 3, [1], [-0.1])] for u in updates)


def test_a_recomputed_chunk_replaces_its_prompt_logprobs():
    sched = stall_free(budget=8)
    prompt = list(range(100, 116))
    seq = Sequence("s", prompt, SamplingParams(max_tokens=2, prompt_logprobs=0), 64)
    sched.add(seq)
    plan = sched.schedule()
    sched.update_from_output(plan, fake_forward(plan))
    sched.update_from_output(plan, fake_forward(plan))  # the same chunk again (a recompute)
    assert [e.token_id for e in seq.meta.prompt_logprobs] == prompt[1:9]


def test_a_request_owing_prompt_logprobs_claims_no_cached_prefix():
    sched = stall_free(prefix_caching=True, budget=64)
    prompt = list(range(100, 124))
    sched.add(Sequence("a", prompt, SamplingParams(max_tokens=1), 64))
    run(sched)
    sched.add(Sequence("b", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0), 64))
    updates, plans = run(sched)
    assert plans[0].chunks[0].num_cached == 0 and len(updates[0].prompt_logprobs) == 23
    sched.add(Sequence("c", prompt, SamplingParams(max_tokens=1), 64))
    _, plans = run(sched)
    assert plans[0].chunks[0].num_cached == 20  # the same prompt, not asking, does hit


def test_prefill_scheduler_hands_the_first_update_its_prompt_logprobs():
    kv = KVCacheManager(64, BS)
    sched = PrefillScheduler(PrefillConfig(chunk_size=8), 8, kv)
    prompt = list(range(1, 13))
    sched.add(Sequence("s", prompt, SamplingParams(max_tokens=4, prompt_logprobs=1), 64))
    updates, _ = run(sched)
    assert len(updates) == 1 and [e.token_id for e in updates[0].prompt_logprobs] == prompt[1:]
    assert sched.take_prefilled()[0].meta.prompt_logprobs == []  # sent: not held any more


def test_prefill_role_streams_them_and_they_survive_the_wire():
    from unit.prefill_instance.test_prefill_role import GATEWAY, make_role

    role = make_role()
    params = SamplingParams(max_tokens=4, logprobs=1, prompt_logprobs=1)
    role.handle(GenerateRequest("r", list(range(1, 6)), params, GATEWAY, time.time()))
    plan = role.schedule()
    role.update_from_output(plan, fake_forward(plan))
    first, = role.ctx.pending_tokens.pop(GATEWAY)
    assert first.token_ids == [TOKEN] and len(first.logprobs) == 1
    assert [e.token_id for e in first.prompt_logprobs] == [2, 3, 4, 5]
    batch = decode(encode(TokenBatch([first])))
    assert batch.items[0].logprobs == first.logprobs
    assert batch.items[0].prompt_logprobs == first.prompt_logprobs
    # array_like: an entry is a 5-array, no field names on the wire
    packed = msgspec.msgpack.encode(TokenLogprobs(5, -0.5, 2, [5, 6], [-0.5, -1.5]))
    assert packed[0] == 0x95 and b"logprob" not in packed and len(packed) < 40
