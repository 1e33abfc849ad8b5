"""Golden plans for the decode scheduler: received sequences, one token each, preemption."""

from __future__ import annotations

from common.block_pool import KVCacheManager
from common.config import BatchConfig
from common.plan import ModelOutput
from common.sampling_params import SamplingParams
from common.schedulers.coupled import CoupledScheduler
from common.schedulers.queues import QueueScheduler
from common.sequence import Sequence, SequenceStatus
from decode_instance.scheduler import DecodeScheduler


def make(budget=16, max_seqs=8, num_blocks=32, block_size=4):
    return DecodeScheduler(BatchConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
                           KVCacheManager(num_blocks, block_size))


def received(sched, seq_id, prompt_len, first_token=100, max_tokens=8):
    """A sequence as the decode role builds it from a KVTransferOffer, its KV in place."""
    s = Sequence(seq_id, list(range(1, prompt_len + 1)) + [first_token],
                 SamplingParams(max_tokens=max_tokens), max_model_len=1000, arrival_time=0.0)
    s.num_prompt_tokens = prompt_len
    s.num_computed_tokens = prompt_len
    assert sched.kv.grow(seq_id, prompt_len + 1) is not None
    sched.add_prefilled(s)
    return s


def shape(plan):
    return [(c.seq_id, c.num_cached, c.num_tokens, c.sampling is not None) for c in plan.chunks]


def step(sched, plan, token=7):
    out = ModelOutput({c.seq_id: token for c in plan.chunks if c.sampling is not None})
    return sched.update_from_output(plan, out)


def test_received_sequence_decodes_one_token_per_forward():
    sched = make()
    a = received(sched, "a", 5, first_token=100)
    b = received(sched, "b", 3, first_token=200)
    assert a.status == SequenceStatus.RUNNING and sched.num_running == 2
    assert not sched.waiting
    plan = sched.schedule()
    assert shape(plan) == [("a", 5, 1, True), ("b", 3, 1, True)]
    assert [c.token_ids for c in plan.chunks] == [[100], [200]]
    assert [c.num_output_tokens for c in plan.chunks] == [1, 1]
    assert plan.chunks[0].block_ids == sched.kv.table("a")
    updates = step(sched, plan, token=9)
    assert [(u.seq_id, u.new_token_ids, u.finish_reason, u.num_output_tokens)
            for u in updates] == [("a", [9], None, 2), ("b", [9], None, 2)]
    assert a.token_ids == [1, 2, 3, 4, 5, 100, 9] and a.num_computed_tokens == 6
    plan = sched.schedule()
    assert shape(plan) == [("a", 6, 1, True), ("b", 4, 1, True)]
    assert [c.token_ids for c in plan.chunks] == [[9], [9]]
    sched.check_integrity()


def test_blocks_grow_as_tokens_are_decoded():
    sched = make(block_size=4)
    a = received(sched, "a", 7)  # 8 tokens: 2 full blocks
    assert len(a.block_ids) == 2
    step(sched, sched.schedule())  # computes token 8 (position 7): still 2 blocks
    assert len(sched.kv.table("a")) == 2
    plan = sched.schedule()  # position 8 needs a third block
    assert shape(plan) == [("a", 8, 1, True)]
    assert len(plan.chunks[0].block_ids) == 3 and a.block_ids == sched.kv.table("a")
    sched.check_integrity()


def test_finishing_frees_blocks():
    sched = make()
    received(sched, "short", 4, max_tokens=2)
    received(sched, "long", 4, max_tokens=5)
    updates = step(sched, sched.schedule())
    assert [(u.seq_id, u.finish_reason) for u in updates] == [("short", "length"),
                                                              ("long", None)]
    assert "short" not in sched.sequences and sched.kv.table("short") == []
    assert sched.num_running == 1
    assert shape(sched.schedule()) == [("long", 5, 1, True)]
    sched.check_integrity()


def test_stop_token_finishes_and_frees():
    sched = make()
    s = Sequence("a", [1, 2, 3, 50], SamplingParams(max_tokens=10, eos_token_ids=(2,)),
                 max_model_len=1000, arrival_time=0.0)
    s.num_prompt_tokens = s.num_computed_tokens = 3
    sched.kv.grow("a", 4)
    sched.add_prefilled(s)
    updates = step(sched, sched.schedule(), token=2)
    assert updates[0].finish_reason == "stop"
    assert not sched.has_work and sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.check_integrity()


def test_abort_frees_blocks():
    sched = make()
    received(sched, "a", 6)
    plan = sched.schedule()
    assert sched.abort("a").finish_reason == "abort"
    assert step(sched, plan) == []
    assert not sched.has_work and sched.num_running == 0
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.check_integrity()


def test_pool_dry_preempts_newest_and_recomputes_by_chunks():
    sched = make(budget=8, num_blocks=4, block_size=4)
    old = received(sched, "old", 7, first_token=100, max_tokens=3)  # 8 tokens: 2 blocks
    new = received(sched, "new", 7, first_token=200, max_tokens=10)  # 2 blocks: pool full
    assert sched.kv.num_free_blocks == 0
    plan = sched.schedule()  # position 7: both still fit their 2 blocks
    assert shape(plan) == [("old", 7, 1, True), ("new", 7, 1, True)]
    step(sched, plan, token=8)
    plan = sched.schedule()  # position 8 needs a 3rd block: "new" is preempted
    assert shape(plan) == [("old", 8, 1, True)]  # 7 tokens of "new" need 2 blocks; 1 is free
    assert sched.num_preemptions == 1
    assert new.status == SequenceStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.block_ids == [] and sched.kv.table("new") == []
    assert list(sched.waiting) == [new] and sched.running == [old]
    assert new.token_ids == list(range(1, 8)) + [200, 8]  # generated tokens are kept
    assert "new" in sched.sequences
    sched.check_integrity()
    updates = step(sched, plan, token=9)  # "old" reaches max_tokens and frees its 3 blocks
    assert updates[0].finish_reason == "length" and sched.kv.num_free_blocks == 4
    # "new" is recomputed from position 0 over prompt + generated tokens, under the budget
    plans = []
    for _ in range(2):
        plan = sched.schedule()
        plans.append(shape(plan))
        chunk = plan.chunks[0]
        assert chunk.token_ids == new.token_ids[chunk.num_cached:chunk.num_cached
                                                + chunk.num_tokens]
        step(sched, plan, token=11)
    assert plans == [[("new", 0, 8, False)], [("new", 8, 1, True)]]
    assert new.status == SequenceStatus.RUNNING
    assert new.token_ids == list(range(1, 8)) + [200, 8, 11] and new.num_computed_tokens == 9
    assert new.num_output_tokens == 3
    assert shape(sched.schedule()) == [("new", 9, 1, True)]  # back to plain decoding
    sched.check_integrity()


def test_victim_is_readmitted_by_chunks_as_soon_as_blocks_allow():
    sched = make(budget=4, num_blocks=4, block_size=4)
    old = received(sched, "old", 7, first_token=100, max_tokens=3)
    new = received(sched, "new", 7, first_token=200, max_tokens=10)
    step(sched, sched.schedule(), token=8)
    plan = sched.schedule()
    # "new" is preempted for old's 3rd block; the 1 block left holds 3 of its tokens (budget 4)
    assert shape(plan) == [("old", 8, 1, True), ("new", 0, 3, False)]
    assert sched.num_preemptions == 1 and new.status == SequenceStatus.RUNNING
    step(sched, plan, token=9)  # old finishes
    assert "old" not in sched.sequences and old.is_finished
    plans = []
    for _ in range(2):
        plan = sched.schedule()
        plans.append(shape(plan))
        step(sched, plan, token=11)
    assert plans == [[("new", 3, 4, False)], [("new", 7, 2, True)]]
    assert new.output_token_ids == [200, 8, 11] and new.num_computed_tokens == 9
    sched.check_integrity()


def test_preemption_spares_sequences_already_in_the_plan():
    sched = make(budget=16, num_blocks=5, block_size=4)
    a = received(sched, "a", 7, max_tokens=20)  # 8 tokens: 2 blocks
    b = received(sched, "b", 7, max_tokens=20)  # 2 blocks
    c = received(sched, "c", 1, max_tokens=20)  # 2 tokens: 1 block; pool full
    step(sched, sched.schedule())  # a, b at 9 tokens (need a 3rd block); c at 3 (fits)
    plan = sched.schedule()
    # a preempts c; b then needs a block too, but the only sequences left are a (in the plan)
    # and b itself, so b sits this forward out, keeping its blocks
    assert shape(plan) == [("a", 8, 1, True)]
    assert c.status == SequenceStatus.PREEMPTED and sched.num_preemptions == 1
    assert a.status == b.status == SequenceStatus.RUNNING
    assert len(sched.kv.table("b")) == 2 and b.num_computed_tokens == 8
    assert list(sched.waiting) == [c]
    sched.check_integrity()


def test_decode_planning_is_its_own_not_a_co_located_policy():
    """Changing a co-located policy (e.g. sarathi) must not change what decode instances run:
    the decode planner shares the queues and preemption, not a policy."""
    assert issubclass(DecodeScheduler, QueueScheduler)
    assert not issubclass(DecodeScheduler, CoupledScheduler)
    assert "schedule" in vars(DecodeScheduler)
