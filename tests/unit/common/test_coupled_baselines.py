"""Golden plans for the vllm, orca, hybrid-only and chunked-only coupled policies."""

from __future__ import annotations

import random

import pytest
from unit.common.coupled_fixtures import add_random, make, run_to_completion, seq, shape, step

from common.plugins import COUPLED_POLICIES
from common.schedulers.coupled import make_coupled_scheduler
from common.sequence import SequenceStatus


def test_registry_names_every_policy():
    assert {"vllm", "orca", "sarathi", "stall-free", "chunked-only", "hybrid-only",
            "fastserve"} <= set(COUPLED_POLICIES.names())
    with pytest.raises(ValueError):  # baselines take no options
        make_coupled_scheduler("vllm", make("vllm").batch, make("vllm").kv, options={"x": 1})


# -- vllm ----------------------------------------------------------------------------------------
def test_vllm_runs_prefill_only_batches_of_whole_prompts_first():
    sched = make("vllm", budget=16)
    for s in (seq("a", 6), seq("b", 8), seq("c", 5)):
        sched.add(s)
    plans = []
    for _ in range(3):
        plan = sched.schedule()
        plans.append(shape(plan))
        step(sched, plan)
    assert plans == [
        [("a", 0, 6, True), ("b", 0, 8, True)],  # c (5) would pass 16 tokens: next batch
        [("c", 0, 5, True)],  # a and b stall: a waiting prompt goes first
        [("a", 6, 1, True), ("b", 8, 1, True), ("c", 5, 1, True)],
    ]


def test_vllm_runs_a_prompt_longer_than_the_budget_alone():
    sched = make("vllm", budget=8)
    sched.add(seq("x", 3))
    sched.add(seq("y", 20))
    first = sched.schedule()
    assert shape(first) == [("x", 0, 3, True)]
    step(sched, first)
    assert shape(sched.schedule()) == [("y", 0, 20, True)]


def test_vllm_decode_preempts_the_newest_and_a_lone_decode_yields_itself():
    sched = make("vllm", budget=16, num_blocks=4, block_size=4)
    sched.add(seq("old", 8, max_tokens=10))
    sched.add(seq("new", 8, max_tokens=10))
    step(sched, sched.schedule())  # both prefilled; 2 blocks each, pool full
    plan = sched.schedule()  # old's 9th token needs a 3rd block: new is recomputed later
    assert shape(plan) == [("old", 8, 1, True)]
    assert sched.sequences["new"].status == SequenceStatus.PREEMPTED
    assert sched.waiting[0].seq_id == "new" and sched.sequences["new"].num_computed_tokens == 0
    sched.check_integrity()


# -- orca and hybrid-only ------------------------------------------------------------------------
def test_orca_mixes_every_decode_with_whole_prompts_without_a_token_budget():
    sched = make("orca", budget=4, max_seqs=3)
    sched.add(seq("a", 3))
    step(sched, sched.schedule())
    for s in (seq("b", 10), seq("c", 12), seq("d", 2)):
        sched.add(s)
    plan = sched.schedule()  # 23 tokens > budget 4: orca has none; max_seqs=3 stops d
    assert shape(plan) == [("a", 3, 1, True), ("b", 0, 10, True), ("c", 0, 12, True)]


def test_hybrid_only_admits_whole_prompts_while_the_batch_is_under_budget():
    sched = make("hybrid-only", budget=8)
    sched.add(seq("a", 3))
    step(sched, sched.schedule())
    for s in (seq("b", 5), seq("c", 4), seq("d", 2)):
        sched.add(s)
    plan = sched.schedule()  # n_t: 1 (a) -> 6 (b) -> 10 (c, admitted at 6 < 8); d waits
    assert shape(plan) == [("a", 3, 1, True), ("b", 0, 5, True), ("c", 0, 4, True)]
    step(sched, plan)
    assert shape(sched.schedule()) == [("a", 4, 1, True), ("b", 5, 1, True), ("c", 4, 1, True),
                                       ("d", 0, 2, True)]


def test_sarathi_chunks_where_hybrid_only_does_not():
    sched = make("sarathi", budget=8)
    sched.add(seq("a", 3))
    step(sched, sched.schedule())
    sched.add(seq("b", 12))
    assert shape(sched.schedule()) == [("a", 3, 1, True), ("b", 0, 7, False)]


# -- chunked-only --------------------------------------------------------------------------------
def test_chunked_only_alternates_prefill_chunks_and_decodes():
    sched = make("chunked-only", budget=8)
    sched.add(seq("a", 3))
    sched.add(seq("b", 10))
    plans = []
    for _ in range(5):
        plan = sched.schedule()
        plans.append(shape(plan))
        step(sched, plan)
    assert plans == [
        [("a", 0, 3, True), ("b", 0, 5, False)],  # prefill turn: chunks only
        [("a", 3, 1, True)],  # decode turn: b is mid-prompt, so it waits
        [("b", 5, 5, True)],  # prefill turn
        [("a", 4, 1, True), ("b", 10, 1, True)],
        [("a", 5, 1, True), ("b", 11, 1, True)],  # no prefill work: the decode turn comes at once
    ]


# -- every policy --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["vllm", "orca", "hybrid-only", "chunked-only", "sarathi"])
@pytest.mark.parametrize("host_blocks", [0, 6])
def test_every_request_completes_under_memory_pressure(policy, host_blocks):
    """A small pool forces preemption (by recompute, or by swap with a host tier); every
    sequence still gets all its tokens, the KV a chunk relies on is where it is claimed, and no
    block leaks."""
    rng = random.Random(policy)
    sched = make(policy, budget=12, max_seqs=4, num_blocks=9, block_size=4,
                 host_blocks=host_blocks)
    wanted = add_random(sched, rng, 12, max_prompt=14, max_tokens=14, spacing=10, min_tokens=4)
    plans, finished = run_to_completion(sched)
    assert finished == wanted
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.num_preemptions > 0
    assert (sum(len(p.swap_out) for p in plans) > 0) == bool(host_blocks)
    if host_blocks:
        assert sched.swap.num_free_blocks == sched.swap.num_blocks
