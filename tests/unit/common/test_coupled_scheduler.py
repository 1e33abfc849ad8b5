"""Golden plans for the stall-free coupled scheduler (pure Python, no model)."""

from __future__ import annotations

from common.block_pool import KVCacheManager
from common.config import BatchConfig
from common.plan import ModelOutput
from common.sampling_params import SamplingParams
from common.schedulers.coupled import StallFreeScheduler
from common.sequence import Sequence, SequenceStatus


def make(budget=8, max_seqs=4, num_blocks=32, block_size=4):
    return StallFreeScheduler(BatchConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
                              KVCacheManager(num_blocks, block_size))


def seq(seq_id, prompt_len, max_tokens=4):
    return Sequence(seq_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    max_model_len=1000)


def shape(plan):
    return [(c.seq_id, c.num_cached, c.num_tokens, c.sampling is not None) for c in plan.chunks]


def step(sched, plan, token=7):
    out = ModelOutput({c.seq_id: token for c in plan.chunks if c.sampling is not None})
    return sched.update_from_output(plan, out)


def test_long_prompt_is_chunked_under_the_budget():
    sched = make(budget=8)
    sched.add(seq("a", 20))
    plans = []
    for _ in range(3):
        plan = sched.schedule()
        plans.append(shape(plan))
        step(sched, plan)
    assert plans == [[("a", 0, 8, False)], [("a", 8, 8, False)], [("a", 16, 4, True)]]


def test_decodes_first_then_partial_prefill_then_new():
    sched = make(budget=8)
    sched.add(seq("a", 3))
    step(sched, sched.schedule())  # a prefilled, first token sampled
    sched.add(seq("b", 10))
    sched.add(seq("c", 2))
    plan = sched.schedule()
    assert shape(plan) == [("a", 3, 1, True), ("b", 0, 7, False)]
    step(sched, plan)
    plan = sched.schedule()
    assert shape(plan) == [("a", 4, 1, True), ("b", 7, 3, True), ("c", 0, 2, True)]


def test_finished_sequences_free_their_blocks():
    sched = make(budget=16)
    sched.add(seq("a", 5, max_tokens=2))
    step(sched, sched.schedule())
    updates = step(sched, sched.schedule())
    assert updates[-1].finish_reason == "length"
    assert not sched.has_work and sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.check_integrity()


def test_pool_exhaustion_preempts_newest_by_recompute():
    sched = make(budget=16, num_blocks=4, block_size=4)
    sched.add(seq("old", 8, max_tokens=10))
    sched.add(seq("new", 8, max_tokens=10))
    step(sched, sched.schedule())  # both prefilled: 2 blocks each, pool full
    plan = sched.schedule()  # old needs a 3rd block for its 9th token: "new" is preempted
    assert [c.seq_id for c in plan.chunks] == ["old"]
    assert sched.num_preemptions == 1
    victim = sched.sequences["new"]
    assert victim.status == SequenceStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert sched.waiting[0] is victim
    sched.check_integrity()


def test_abort_releases_everything():
    sched = make()
    sched.add(seq("a", 6))
    sched.schedule()
    update = sched.abort("a")
    assert update.finish_reason == "abort"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.has_work
