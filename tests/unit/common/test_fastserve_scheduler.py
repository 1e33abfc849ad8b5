"""FastServe: the skip-join MLFQ's arithmetic, golden plans of the scheduler, proactive swap."""

from __future__ import annotations

import itertools
import random

import pytest
from unit.common.coupled_fixtures import FakeKV, make, run_to_completion, seq, shape, step

from common.config import ConfigError
from common.schedulers.fastserve import FastServeOptions, JobProfiler
from common.schedulers.mlfq import SkipJoinMLFQ
from common.sequence import SequenceStatus

# q1 = 1 s, so the quanta are 1, 2, 4, 8 and a prompt of n tokens costs max(1, n / 4) seconds.
OPTIONS = dict(seconds_per_decode_iteration=1.0, seconds_per_prefill_token=0.25, num_queues=4,
               starvation_limit_s=100.0)


def fastserve(max_seqs=1, budget=64, num_blocks=32, host_blocks=0, **options):
    sched = make("fastserve", budget=budget, max_seqs=max_seqs, num_blocks=num_blocks,
                 block_size=4, host_blocks=host_blocks, options={**OPTIONS, **options})
    sched.now = 0.0
    sched.clock = lambda: sched.now
    return sched


def trace(sched, tick=0.0):
    """(seq_id, num_cached, num_tokens) of every forward until the scheduler is idle."""
    plans = []
    while sched.has_work:
        plan = sched.schedule()
        plans.append([c[:3] for c in shape(plan)])
        step(sched, plan)
        sched.now += tick
    return plans


# -- the MLFQ ------------------------------------------------------------------------------------
def test_quanta_double_and_jobs_skip_join_by_first_iteration_time():
    mlfq = SkipJoinMLFQ(1.0, 4, 100.0)
    assert mlfq.quanta == [1.0, 2.0, 4.0, 8.0]
    assert [mlfq.entry_level(t) for t in (0.5, 1.0, 1.5, 4.0, 100.0)] == [0, 0, 1, 2, 3]


def test_a_job_is_demoted_once_it_used_its_quantum():
    mlfq = SkipJoinMLFQ(1.0, 3, 100.0)
    mlfq.join("j", 0.5, now=0.0)
    mlfq.charge("j", 1.0, next_iteration_s=1.0, now=1.0)
    assert mlfq.level("j") == 1
    mlfq.charge("j", 1.0, 1.0, now=2.0)
    assert mlfq.level("j") == 1  # 1 of 2 s used
    mlfq.charge("j", 1.0, 1.0, now=3.0)
    assert mlfq.level("j") == 2
    for _ in range(5):
        mlfq.charge("j", 1.0, 1.0, now=4.0)
    assert mlfq.level("j") == 2 and mlfq.num_demotions == 2  # the last queue keeps it


def test_starved_jobs_return_to_the_back_of_q1():
    mlfq = SkipJoinMLFQ(1.0, 4, starvation_limit_s=5.0)
    mlfq.join("top", 0.5, now=0.0)
    mlfq.join("long", 3.0, now=0.0)  # level 2
    assert mlfq.promote_starved(4.9) == []
    assert mlfq.promote_starved(5.0) == ["long"]  # "top" is in Q1 already and keeps its place
    assert mlfq.order() == ["top", "long"] and mlfq.level("long") == 0
    assert mlfq.jobs["long"].last_run == 5.0


def test_enst_is_the_earlier_of_promotion_and_execution():
    mlfq = SkipJoinMLFQ(1.0, 4, starvation_limit_s=10.0)
    for job_id, first_iteration_s in (("a", 1.0), ("b", 2.0), ("c", 4.0)):
        mlfq.join(job_id, first_iteration_s, now=0.0)  # levels 0, 1, 2
    # T_execute(b) = (q1 + q2) / B; T_execute(c) = ((q1+q2+q3) + (q2+q3)) / B, B = 2
    assert mlfq.enst(["a", "b", "c"], now=0.0, batch_size=2) == {"a": 0.0, "b": 1.5, "c": 6.5}
    mlfq.jobs["c"].last_run = -8.0  # 2 s from promotion
    assert mlfq.enst(["a", "b", "c"], now=0.0, batch_size=2)["c"] == 2.0


def test_options_are_validated():
    with pytest.raises(ConfigError):
        FastServeOptions(starvation_limit_s=0.0)
    with pytest.raises(ConfigError):
        FastServeOptions(max_reserve_fraction=1.5)
    profiler = JobProfiler.build(FastServeOptions(seconds_per_decode_iteration=0.02,
                                                  seconds_per_prefill_token=0.001), None)
    assert profiler.iteration_s(100) == 0.1 and profiler.iteration_s(1) == 0.02


# -- golden plans --------------------------------------------------------------------------------
def test_skip_join_runs_short_jobs_before_a_long_prompt():
    sched = fastserve()
    for s in (seq("A", 16, 3), seq("B", 4, 3), seq("C", 6, 3)):  # t_init 4, 1, 1.5: Q3, Q1, Q2
        sched.add(s)
    assert trace(sched) == [
        [("B", 0, 4)],  # Q1; used q1 = 1 s: down to Q2, behind C
        [("C", 0, 6)],  # Q2 head; 1.5 of 2 s used
        [("C", 6, 1)],  # 2.5 s: down to Q3, behind A
        [("B", 4, 1)],
        [("B", 5, 1)],  # B's third token: done
        [("A", 0, 16)],  # Q3 head; used its 4 s: down to Q4
        [("C", 7, 1)],
        [("A", 16, 1)],
        [("A", 17, 1)],
    ]


def test_naive_mlfq_puts_every_job_in_q1_so_the_long_prompt_goes_first():
    sched = fastserve(skip_join=False)
    for s in (seq("A", 16, 3), seq("B", 4, 3), seq("C", 6, 3)):
        sched.add(s)
    assert trace(sched)[:3] == [[("A", 0, 16)], [("B", 0, 4)], [("C", 0, 6)]]


def test_starvation_promotion_lets_a_long_job_overtake():
    def long_prefill_index(alpha):
        sched = fastserve(starvation_limit_s=alpha)
        for i in range(5):
            sched.add(seq(f"S{i}", 2, 3))
        sched.add(seq("L", 16, 3))
        plans = trace(sched, tick=1.0)
        return plans.index([("L", 0, 16)])

    assert long_prefill_index(1000.0) == 15  # after all 15 forwards of the short jobs
    assert long_prefill_index(3.0) == 5  # promoted at t=3, behind the Q1 jobs S3 and S4


def test_a_batch_takes_jobs_by_priority_under_the_prompt_token_cap():
    sched = fastserve(max_seqs=4, budget=8)
    for s in (seq("A", 16, 3), seq("B", 4, 3), seq("C", 6, 3), seq("D", 2, 3)):
        sched.add(s)
    # order B, D (Q1), C (Q2), A (Q3): C would pass 8 prompt tokens; A is a lone prompt later
    assert shape(sched.schedule()) == [("B", 0, 4, True), ("D", 0, 2, True)]


def test_memory_shortage_swaps_out_the_latest_enst_and_resumes_without_recompute():
    sched = fastserve(num_blocks=4, host_blocks=8, proactive=False,
                      seconds_per_prefill_token=0.01)  # both prompts join Q1
    sched.add(seq("A", 7, 5))
    sched.add(seq("B", 7, 5, first=50))
    fake, plans = FakeKV(4), []
    for _ in range(5):
        plan = sched.schedule()
        plans.append((shape(plan), plan.swap_out, plan.swap_in))
        sched.update_from_output(plan, fake.execute(plan, sched))  # checks the KV contents
        sched.check_integrity()
    assert plans == [
        ([("A", 0, 7, True)], [], []),  # A: blocks 0, 1
        ([("B", 0, 7, True)], [], []),  # B: blocks 2, 3; pool full
        ([("A", 7, 1, True)], [], []),
        # A's 9th token needs a block: B (lower priority now) goes to host blocks 0, 1
        ([("A", 8, 1, True)], [(2, 0), (3, 1)], []),
        # A used Q2's quantum; B is ahead and needs its blocks back: A goes out first, then B
        # comes in, reusing device block 3 that A's swap-out frees in the same plan
        ([("B", 7, 1, True)], [(0, 2), (1, 3), (3, 4)], [(0, 2), (1, 3)]),
    ]
    assert sched.sequences["B"].num_computed_tokens == 8  # resumed, not recomputed
    assert sched.sequences["A"].status == SequenceStatus.PREEMPTED


def test_proactive_swap_keeps_a_reserve_and_swaps_in_ahead_of_need():
    # no arrival history: the reserve is the 2 fixed blocks plus the next token's blocks
    sched = fastserve(num_blocks=6, host_blocks=8, reserved_blocks=2, burst_window=0,
                      seconds_per_prefill_token=0.01)
    sched.add(seq("A", 7, 3))
    sched.add(seq("S", 7, 8, first=50))
    fake, plans = FakeKV(4), []
    for i in range(6):
        if i == 4:
            sched.add(seq("T", 7, 8, first=80))
        plan = sched.schedule()
        plans.append((shape(plan), plan.swap_out, plan.swap_in, sched.reserve))
        sched.update_from_output(plan, fake.execute(plan, sched))
        sched.check_integrity()
    assert plans == [
        ([("A", 0, 7, True)], [], [], 2),
        ([("S", 0, 7, True)], [], [], 2),  # 2 free = the reserve
        # A's 9th token will need a block: reserve 3 > 2 free, so S, not scheduled, goes out
        # early (latest ENST), before A's next forward would have to evict it
        ([("A", 7, 1, True)], [(2, 0), (3, 1)], [], 3),
        # A takes its new block; bringing S back (2 blocks) would leave 1 < 2 free: S stays out
        ([("A", 8, 1, True)], [], [], 2),
        # A finished; T runs, and S comes back while T runs, before its own turn
        ([("T", 0, 7, True)], [], [(0, 2), (1, 4)], 2),
        # S is resident already: no swap on its critical path; its 9th token will need a block,
        # so T, now below S, goes out for the reserve
        ([("S", 7, 1, True)], [(5, 2), (3, 3)], [], 3),
    ]


def test_the_arrival_burst_reserve_makes_room_before_the_next_burst():
    """L and M arrive together (2 x 6 blocks): the reserve is then min(0.5 x 16, 12) = 8 blocks.
    With it, L goes out in the forward that admits M, so N's arrival finds 10 free blocks and
    runs at once (M goes out after N's selection, for the reserve); without it, N finds 4 free
    blocks and M must be evicted on N's critical path."""

    def run(burst_window):
        sched = fastserve(num_blocks=16, host_blocks=32, burst_window=burst_window,
                          seconds_per_prefill_token=0.01)  # every prompt joins Q1
        sched.add(seq("L", 23, 8))
        sched.add(seq("M", 23, 8, first=50))
        fake, plans = FakeKV(4), []
        for i in range(3):
            if i == 2:
                sched.add(seq("N", 23, 8, first=80))
            free = sched.kv.num_free_blocks
            plan = sched.schedule()
            plans.append((free, shape(plan)[0][0], [d for d, _ in plan.swap_out], sched.reserve))
            sched.update_from_output(plan, fake.execute(plan, sched))
            sched.check_integrity()
        return plans

    assert run(burst_window=64) == [(16, "L", [], 8), (10, "M", [0, 1, 2, 3, 4, 5], 8),
                                    (10, "N", [6, 7, 8, 9, 10, 11], 8)]
    assert run(burst_window=0) == [(16, "L", [], 0), (10, "M", [], 0),
                                   (4, "N", [6, 7, 8, 9, 10, 11], 0)]


def test_no_job_is_evicted_for_one_that_would_not_fit_anyway():
    sched = fastserve(max_seqs=3, num_blocks=5, host_blocks=8, proactive=False)
    sched.add(seq("B", 7, 5))
    sched.add(seq("A", 3, 5, first=50))
    step(sched, sched.schedule())  # B holds 2 blocks, A 1; 2 free
    sched.add(seq("H", 13, 5, first=80))  # needs 4 blocks
    for job_id, level in (("B", 0), ("H", 1), ("A", 2)):  # hand-built queues: B, H, A
        sched.mlfq.jobs[job_id].level = level
    plan = sched.schedule()
    # evicting A would free 1 block: 3 < 4, so H waits and A keeps its blocks and runs
    assert shape(plan) == [("B", 7, 1, True), ("A", 3, 1, True)] and not plan.swap_out


def test_without_a_host_tier_the_latest_enst_is_recomputed():
    sched = fastserve(num_blocks=4, seconds_per_prefill_token=0.01)
    sched.add(seq("A", 7, 5))
    sched.add(seq("B", 7, 5, first=50))
    for _ in range(4):
        plan = sched.schedule()
        step(sched, plan)
    assert shape(plan) == [("A", 8, 1, True)] and not plan.swap_out
    assert sched.sequences["B"].num_computed_tokens == 0 and sched.waiting[0].seq_id == "B"


@pytest.mark.parametrize("host_blocks,proactive", [(0, False), (6, False), (6, True)])
def test_every_job_completes_under_memory_pressure(host_blocks, proactive):
    rng = random.Random(host_blocks + proactive)
    sched = fastserve(max_seqs=3, budget=12, num_blocks=9, host_blocks=host_blocks,
                      proactive=proactive, reserved_blocks=1, starvation_limit_s=4.0)
    wanted = {}
    for i in range(12):
        s = seq(f"s{i}", rng.randint(2, 14), max_tokens=rng.randint(4, 14), first=10 * i + 1)
        wanted[s.seq_id] = s.sampling.max_tokens
        sched.add(s)
    ticks = itertools.count()
    sched.clock = lambda: next(ticks) * 0.5  # time passes, so jobs starve and get promoted
    plans, finished = run_to_completion(sched)
    assert finished == wanted
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.num_preemptions > 0 and sched.mlfq.num_promotions > 0
    assert (sum(len(p.swap_out) for p in plans) > 0) == bool(host_blocks)


# -- counters ------------------------------------------------------------------------------------
def test_counters_name_the_entry_queues_and_which_swaps_were_proactive():
    """The proactive trace above, counted: S goes out ahead of need and comes back ahead of its
    turn (one proactive swap each way), then T goes out for the reserve; nothing recomputed."""
    sched = fastserve(num_blocks=6, host_blocks=8, reserved_blocks=2, burst_window=0,
                      seconds_per_prefill_token=0.01)
    sched.add(seq("A", 7, 3))
    sched.add(seq("S", 7, 8, first=50))
    fake = FakeKV(4)
    for i in range(6):
        if i == 4:
            sched.add(seq("T", 7, 8, first=80))
        plan = sched.schedule()
        sched.update_from_output(plan, fake.execute(plan, sched))
    counters = sched.counters()
    assert counters["entered_q1"] == 3 and counters["entered_q4"] == 0  # 0.07 s <= q1
    assert counters["swap_outs"] == 2 and counters["proactive_swap_outs"] == 2
    assert counters["swap_ins"] == 1 and counters["proactive_swap_ins"] == 1
    assert counters["blocks_swapped_out"] == 4 and counters["blocks_swapped_in"] == 2
    assert counters["preemptions"] == 2 and counters["recomputes"] == 0


def test_counters_of_reactive_swaps_and_of_recomputes():
    reactive = fastserve(num_blocks=4, host_blocks=8, proactive=False,
                         seconds_per_prefill_token=0.01)
    recompute = fastserve(num_blocks=4, seconds_per_prefill_token=0.01)  # no host tier
    for sched in (reactive, recompute):
        sched.add(seq("A", 7, 5))
        sched.add(seq("B", 7, 5, first=50))
        for _ in range(5):
            step(sched, sched.schedule())
    # the golden plans above: B out at the 4th forward, A out and B in at the 5th
    assert {k: reactive.counters()[k] for k in ("swap_outs", "swap_ins", "recomputes",
                                                 "proactive_swap_outs")} == \
        {"swap_outs": 2, "swap_ins": 1, "recomputes": 0, "proactive_swap_outs": 0}
    assert recompute.counters()["recomputes"] >= 1 and recompute.counters()["swap_outs"] == 0
    assert recompute.counters()["preemptions"] == recompute.num_preemptions


def test_skip_join_spreads_entries_over_the_queues_and_naive_mlfq_does_not():
    levels = {}
    for skip_join in (True, False):
        sched = fastserve(max_seqs=3, skip_join=skip_join)
        for seq_id, prompt_len, first in (("short", 3, 1), ("mid", 6, 20), ("long", 16, 40)):
            sched.add(seq(seq_id, prompt_len, 2, first=first))
        levels[skip_join] = [sched.counters()[f"entered_q{k}"] for k in range(1, 5)]
    # costs max(1, n/4) s against quanta 1, 2, 4, 8: 3 tokens -> Q1, 6 -> Q2, 16 -> Q3
    assert levels[True] == [1, 1, 1, 0]
    assert levels[False] == [3, 0, 0, 0]
