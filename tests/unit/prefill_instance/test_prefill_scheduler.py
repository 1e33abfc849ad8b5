"""Golden plans for the prefill scheduler: sched-batch windows, policies, merged fixed-size chunks."""

from __future__ import annotations

import pytest

from common.block_pool import KVCacheManager
from common.config import PrefillConfig
from common.plan import ModelOutput
from common.sampling_params import SamplingParams
from common.sequence import Sequence, SequenceStatus
from prefill_instance.scheduler import PrefillScheduler


def make(policy="fcfs", sched_batch=16, chunk=8, pad=False, num_blocks=64, block_size=4):
    return PrefillScheduler(PrefillConfig(policy=policy, sched_batch=sched_batch,
                                          pad_last_chunk=pad),
                            chunk, KVCacheManager(num_blocks, block_size))


def seq(seq_id, prompt_len, t=0.0, max_tokens=4):
    return Sequence(seq_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    max_model_len=1000, arrival_time=t)


def shape(plan):
    return [(c.seq_id, c.num_cached, c.num_tokens, c.sampling is not None) for c in plan.chunks]


def step(sched, plan, token=7):
    out = ModelOutput({c.seq_id: token for c in plan.chunks if c.sampling is not None})
    return sched.update_from_output(plan, out)


def run(sched, max_plans=50):
    """Schedule and absorb until a plan is empty; the shapes of every plan."""
    plans = []
    for _ in range(max_plans):
        plan = sched.schedule()
        if plan.is_empty:
            return plans
        plans.append(shape(plan))
        step(sched, plan)
    raise AssertionError("scheduler never ran dry")


def live_ids(sched, taken):
    return set(sched.sequences) | {s.seq_id for s in taken}


# -- ordering of the scheduled queue --------------------------------------------------------------
ARRIVALS = [("a", 6, 3.0), ("b", 2, 1.0), ("c", 4, 2.0), ("d", 4, 0.5)]


@pytest.mark.parametrize("policy, order", [
    ("fcfs", ["d", "b", "c", "a"]),  # by arrival time, not by insertion order
    ("sjf", ["b", "d", "c", "a"]),  # shortest prompt first; equal lengths by arrival
    ("ljf", ["a", "d", "c", "b"]),  # longest prompt first; equal lengths by arrival
])
def test_policy_orders_the_scheduled_queue(policy, order):
    sched = make(policy=policy, chunk=100)
    for seq_id, n, t in ARRIVALS:
        sched.add(seq(seq_id, n, t))
    plan = sched.schedule()
    assert [s.seq_id for s in sched.scheduled] == order
    assert [c.seq_id for c in plan.chunks] == order
    assert all(c.sampling is not None for c in plan.chunks)
    assert not sched.raw


def test_sjf_golden_plans_with_chunking():
    sched = make(policy="sjf", chunk=8)
    for seq_id, n, t in ARRIVALS:
        sched.add(seq(seq_id, n, t))
    assert run(sched) == [
        [("b", 0, 2, True), ("d", 0, 4, True), ("c", 0, 2, False)],
        [("c", 2, 2, True), ("a", 0, 6, True)],
    ]


# -- PrefillSchedBatch windows --------------------------------------------------------------------
def test_only_sched_batch_requests_are_sorted_at_a_time():
    sched = make(policy="sjf", sched_batch=2, chunk=100)
    sched.add(seq("long", 10, 0.0))
    sched.add(seq("mid", 5, 1.0))
    sched.add(seq("short", 1, 2.0))  # shortest overall, but in the second window
    plan = sched.schedule()
    assert shape(plan) == [("mid", 0, 5, True), ("long", 0, 10, True)]
    assert [s.seq_id for s in sched.raw] == ["short"]
    step(sched, plan)
    assert shape(sched.schedule()) == [("short", 0, 1, True)]


def test_next_window_waits_until_the_scheduled_queue_runs_dry():
    sched = make(policy="sjf", sched_batch=2, chunk=8)
    sched.add(seq("a", 10, 0.0))
    sched.add(seq("b", 4, 1.0))
    plan = sched.schedule()
    assert shape(plan) == [("b", 0, 4, True), ("a", 0, 4, False)]
    sched.add(seq("late", 2, 5.0))  # short, but arrives after the window was taken
    step(sched, plan)
    # 2 tokens of budget are left over, yet "late" does not ride along: its window is not open
    plan = sched.schedule()
    assert shape(plan) == [("a", 4, 6, True)]
    assert [s.seq_id for s in sched.raw] == ["late"]
    step(sched, plan)
    assert run(sched) == [[("late", 0, 2, True)]]


def test_windows_follow_arrival_order_of_the_raw_queue():
    sched = make(policy="ljf", sched_batch=2, chunk=100)
    for i, n in enumerate([1, 2, 3, 4, 5]):
        sched.add(seq(f"s{n}", n, float(i)))
    assert [[c[0] for c in plan] for plan in run(sched)] == [["s2", "s1"], ["s4", "s3"], ["s5"]]


# -- fixed-size chunks ----------------------------------------------------------------------------
def test_chunks_are_merged_across_requests_up_to_chunk_size():
    sched = make(chunk=8)
    sched.add(seq("a", 5, 0.0))
    sched.add(seq("b", 6, 1.0))
    plan = sched.schedule()
    assert shape(plan) == [("a", 0, 5, True), ("b", 0, 3, False)]
    assert plan.num_tokens == 8 and plan.num_padding_tokens == 0
    step(sched, plan)
    plan = sched.schedule()
    assert shape(plan) == [("b", 3, 3, True)]
    assert plan.chunks[0].token_ids == [4, 5, 6]
    step(sched, plan)
    assert sched.schedule().is_empty


def test_long_prompt_spans_several_chunks_and_samples_only_at_its_end():
    sched = make(chunk=8)
    sched.add(seq("a", 20, 0.0))
    sched.add(seq("b", 3, 1.0))
    assert run(sched) == [
        [("a", 0, 8, False)],
        [("a", 8, 8, False)],
        [("a", 16, 4, True), ("b", 0, 3, True)],
    ]


def test_chunk_contents_positions_and_blocks():
    sched = make(chunk=8, block_size=4)
    sched.add(seq("a", 11, 0.0))
    plan = sched.schedule()
    chunk = plan.chunks[0]
    assert chunk.token_ids == list(range(1, 9)) and chunk.num_cached == 0
    assert len(chunk.block_ids) == 2 and chunk.sampling is None
    step(sched, plan)
    chunk = sched.schedule().chunks[0]
    assert chunk.token_ids == [9, 10, 11] and chunk.num_cached == 8
    assert len(chunk.block_ids) == 3 and chunk.block_ids[:2] == plan.chunks[0].block_ids
    assert chunk.sampling == SamplingParams(max_tokens=4) and chunk.num_output_tokens == 0


@pytest.mark.parametrize("pad", [False, True])
def test_pad_last_chunk_fills_the_chunk(pad):
    sched = make(chunk=8, pad=pad)
    sched.add(seq("a", 5, 0.0))
    sched.add(seq("b", 6, 1.0))
    first = sched.schedule()
    assert first.num_padding_tokens == 0  # already full
    step(sched, first)
    last = sched.schedule()
    assert shape(last) == [("b", 3, 3, True)]
    assert last.num_padding_tokens == (5 if pad else 0)
    assert last.num_tokens == (8 if pad else 3)
    step(sched, last)
    assert sched.schedule().num_padding_tokens == 0  # an empty plan is never padded


# -- hand-off -------------------------------------------------------------------------------------
def test_take_prefilled_hands_over_sequences_with_their_blocks():
    sched = make(chunk=8, block_size=4)
    sched.add(seq("a", 5, 0.0))
    sched.add(seq("b", 6, 1.0))
    plan = sched.schedule()
    updates = step(sched, plan)
    assert [(u.seq_id, u.new_token_ids, u.finish_reason) for u in updates] == [("a", [7], None)]
    taken = sched.take_prefilled()
    assert [s.seq_id for s in taken] == ["a"]
    a = taken[0]
    assert "a" not in sched.sequences and a not in sched.scheduled
    assert a.token_ids == [1, 2, 3, 4, 5, 7] and a.num_computed_tokens == 5
    assert a.is_prefilled and not a.is_finished
    assert sched.kv.table("a") == a.block_ids and len(a.block_ids) == 2
    assert sched.take_prefilled() == []  # handed over once
    step(sched, sched.schedule())
    assert [s.seq_id for s in sched.take_prefilled()] == ["b"]
    assert not sched.has_work and sched.kv.num_free_blocks == sched.kv.num_blocks - 4
    sched.kv.check_integrity({"a", "b"})
    sched.kv.free("a")
    sched.kv.free("b")
    sched.kv.check_integrity(set())


def test_sequence_finished_by_its_first_token_is_freed_not_handed_over():
    sched = make(chunk=16)
    sched.add(seq("one", 5, 0.0, max_tokens=1))
    sched.add(seq("two", 5, 1.0, max_tokens=2))
    updates = step(sched, sched.schedule())
    assert [(u.seq_id, u.finish_reason) for u in updates] == [("one", "length"), ("two", None)]
    assert [s.seq_id for s in sched.take_prefilled()] == ["two"]
    assert sched.kv.table("one") == []
    assert sched.kv.num_free_blocks == sched.kv.num_blocks - 2
    sched.kv.check_integrity({"two"})


def test_sequence_stopped_by_eos_first_token_is_freed():
    sched = make(chunk=16)
    s = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=10, eos_token_ids=(7,)),
                 max_model_len=1000, arrival_time=0.0)
    sched.add(s)
    updates = step(sched, sched.schedule(), token=7)
    assert updates[0].finish_reason == "stop"
    assert sched.take_prefilled() == [] and sched.kv.num_free_blocks == sched.kv.num_blocks


# -- KV pool ---------------------------------------------------------------------------------------
def test_out_of_blocks_stops_the_plan_without_leaking():
    sched = make(chunk=32, num_blocks=5, block_size=4)
    sched.add(seq("a", 8, 0.0))  # 2 blocks
    sched.add(seq("b", 8, 1.0))  # 2 blocks
    sched.add(seq("c", 8, 2.0))  # 2 blocks: only 1 left
    sched.add(seq("d", 1, 3.0))  # 1 block would fit, but the plan stops at "c"
    plan = sched.schedule()
    assert shape(plan) == [("a", 0, 8, True), ("b", 0, 8, True)]
    assert sched.kv.table("c") == [] and sched.kv.table("d") == []
    assert sched.sequences["c"].status == SequenceStatus.WAITING
    assert sched.kv.num_free_blocks == 1
    sched.check_integrity()
    step(sched, plan)
    taken = sched.take_prefilled()
    assert [s.seq_id for s in taken] == ["a", "b"]
    assert sched.schedule().is_empty  # blocks are held under leases
    sched.kv.check_integrity(live_ids(sched, taken))
    sched.kv.free("a")  # a decode instance has copied a's KV
    plan = sched.schedule()
    assert shape(plan) == [("c", 0, 8, True), ("d", 0, 1, True)]  # 3 blocks free: both fit
    step(sched, plan)
    taken += sched.take_prefilled()
    assert [s.seq_id for s in taken] == ["a", "b", "c", "d"]
    assert sched.kv.num_free_blocks == 0 and not sched.has_work
    sched.kv.check_integrity(live_ids(sched, taken) - {"a"})
    with pytest.raises(Exception, match="not live"):
        sched.kv.check_integrity({"b", "c"})  # the check does see a leak


def test_partial_prompt_keeps_its_blocks_while_waiting_for_more():
    sched = make(chunk=8, num_blocks=3, block_size=4)
    sched.add(seq("a", 16, 0.0))  # needs 4 blocks, the pool has 3
    plan = sched.schedule()
    assert shape(plan) == [("a", 0, 8, False)]
    step(sched, plan)
    assert shape(sched.schedule()) == []  # 8 more tokens need 2 blocks; 1 free
    assert len(sched.kv.table("a")) == 2 and sched.num_queued_tokens == 8
    sched.check_integrity()


def test_abort_frees_blocks_and_queues():
    sched = make(sched_batch=2, chunk=8, block_size=4)
    sched.add(seq("a", 12, 0.0))
    sched.add(seq("b", 3, 1.0))
    sched.add(seq("queued", 3, 2.0))  # still in the raw queue: outside the first window
    plan = sched.schedule()
    assert shape(plan) == [("a", 0, 8, False)]
    update = sched.abort("a")
    assert (update.seq_id, update.finish_reason, update.num_prompt_tokens) == ("a", "abort", 12)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and sched.kv.table("a") == []
    assert "a" not in sched.sequences and all(s.seq_id != "a" for s in sched.scheduled)
    assert step(sched, plan) == []  # the aborted sequence's forward is ignored
    assert [s.seq_id for s in sched.raw] == ["queued"]
    assert sched.abort("queued").finish_reason == "abort"
    assert [s.seq_id for s in sched.raw] == []
    assert sched.abort("nope") is None
    assert run(sched) == [[("b", 0, 3, True)]]
    assert [s.seq_id for s in sched.take_prefilled()] == ["b"]
    sched.kv.check_integrity({"b"})


def test_num_queued_tokens_counts_unprefilled_prompt_tokens():
    sched = make(chunk=8)
    sched.add(seq("a", 10, 0.0))
    sched.add(seq("b", 5, 1.0))
    assert sched.num_queued_tokens == 15
    step(sched, sched.schedule())
    assert sched.num_queued_tokens == 7
    step(sched, sched.schedule())
    assert sched.num_queued_tokens == 0 and not sched.has_work
