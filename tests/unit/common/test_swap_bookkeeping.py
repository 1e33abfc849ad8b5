"""SwapSpace (host block ids, swap pairs, deferred frees) and preemption by swap in the base."""

from __future__ import annotations

import pytest
from unit.common.coupled_fixtures import FakeKV, make, seq, shape

from common.block_pool import BlockPoolError, KVCacheManager
from common.plan import BatchPlan
from common.schedulers.swapping import SwapSpace
from common.sequence import SequenceStatus


def prefilled(kv, seq_id, num_tokens):
    s = seq(seq_id, num_tokens)
    kv.grow(seq_id, num_tokens)
    s.kv = kv  # its block table is the one kv keeps
    s.num_computed_tokens = num_tokens
    return s


def test_swap_out_moves_ownership_to_host_blocks_and_back():
    kv, swap = KVCacheManager(8, 4), SwapSpace(4)
    kv.grow("other", 4)  # device block 0
    s = prefilled(kv, "s", 10)  # device blocks 1, 2, 3
    assert swap.swap_out(s, kv) == [(1, 0), (2, 1), (3, 2)]
    assert kv.num_free_blocks == 7 and s.block_ids == [] and swap.num_blocks_of("s") == 3
    assert swap.num_device_blocks_to_resume(s, kv, 1) == 3  # 11 tokens still fit 3 blocks
    assert swap.num_device_blocks_to_resume(s, kv, 3) == 4
    pairs = swap.swap_in(s, kv)
    assert [h for h, _ in pairs] == [0, 1, 2] and [d for _, d in pairs] == kv.table("s")
    assert s.block_ids == kv.table("s") and not swap.is_swapped("s")
    # the host blocks stay held until the plan that copies them has run
    assert swap.num_free_blocks == 1
    swap.check_integrity(live_seq_ids=[])
    swap.release_deferred()
    assert swap.num_free_blocks == 4
    kv.check_integrity(["other", "s"])


def test_swap_out_refuses_when_the_host_tier_is_short():
    kv, swap = KVCacheManager(8, 4), SwapSpace(2)
    s = prefilled(kv, "s", 10)
    assert swap.swap_out(s, kv) is None
    assert kv.table("s") == s.block_ids and len(s.block_ids) == 3 and swap.num_free_blocks == 2
    assert swap.swap_in(s, kv) is None  # not swapped out


def test_discard_and_integrity():
    kv, swap = KVCacheManager(8, 4), SwapSpace(4)
    s = prefilled(kv, "s", 6)
    swap.swap_out(s, kv)
    with pytest.raises(BlockPoolError):
        swap.check_integrity(live_seq_ids=[])  # "s" holds host blocks but is not live
    swap.discard("s")
    swap.check_integrity(live_seq_ids=[])
    assert swap.num_free_blocks == 4


def test_runner_plan_of_swaps_alone_is_not_empty():
    assert BatchPlan([]).is_empty
    assert not BatchPlan([], swap_out=[(1, 0)]).is_empty
    assert BatchPlan([], swap_in=[(0, 1)]).has_swaps


def test_stall_free_preempts_by_swap_and_resumes_where_it_stopped():
    sched = make("sarathi", budget=16, num_blocks=4, block_size=4, host_blocks=4)
    sched.add(seq("old", 8, max_tokens=2))
    sched.add(seq("new", 8, max_tokens=10, first=50))
    fake = FakeKV(4)
    plans = []
    for _ in range(4):
        plan = sched.schedule()
        plans.append((shape(plan), plan.swap_out, plan.swap_in))
        sched.update_from_output(plan, fake.execute(plan, sched))
        sched.check_integrity()
    assert plans == [
        ([("old", 0, 8, True), ("new", 0, 8, True)], [], []),  # pool full
        # old's 9th token needs a block: new is swapped out, keeping its KV (blocks 2, 3)
        ([("old", 8, 1, True)], [(2, 0), (3, 1)], []),
        ([("new", 8, 1, True)], [], [(0, 2), (1, 3)]),  # old finished: new comes back
        ([("new", 9, 1, True)], [], []),
    ]
    assert sched.num_preemptions == 1 and sched.swap.num_swap_ins == 1
    assert sched.sequences["new"].status == SequenceStatus.RUNNING


def test_abort_of_a_swapped_out_sequence_frees_its_host_blocks():
    sched = make("sarathi", budget=16, num_blocks=4, block_size=4, host_blocks=4)
    sched.add(seq("old", 8, max_tokens=5))
    sched.add(seq("new", 8, max_tokens=5))
    fake = FakeKV(4)
    for _ in range(2):
        plan = sched.schedule()
        sched.update_from_output(plan, fake.execute(plan, sched))
    assert sched.swapped and sched.swap.num_free_blocks == 2
    assert sched.abort("new").finish_reason == "abort"
    assert not sched.swapped and sched.swap.num_free_blocks == 4
    sched.check_integrity()
