"""SARATHI's decode-maximal policy: the chunk size from the P:D ratio, golden plans, one prefill
chunk per forward under memory pressure."""

from __future__ import annotations

import random

import pytest
from unit.common.coupled_fixtures import add_random, make, run_to_completion, seq, shape, step

from common.config import ConfigError
from common.plugins import COUPLED_POLICIES
from common.schedulers.decode_maximal import DecodeMaximalOptions, PDRatio, decode_maximal_chunk


def test_the_chunk_fills_the_decode_slots_at_the_p_d_ratio():
    # SARATHI Table 4: (batch, P:D) -> C = P:D x (B - 1), all near the chunk of 256 used there
    assert [decode_maximal_chunk(pd, b, tau=4096) for b, pd in ((6, 50), (10, 28), (5, 63),
                                                               (3, 127))] == [250, 252, 252, 254]
    # the two-step rule: C = 256 with batch 4 and tile 128 -> 256 - (B - 1) = 253 prompt tokens
    assert decode_maximal_chunk(256 / 3, 4, tau=4096, tile=128) == 253
    assert decode_maximal_chunk(None, 128, tau=512) == 512  # P:D unknown yet: tau
    assert decode_maximal_chunk(0.01, 128, tau=512, min_chunk=16) == 16
    assert decode_maximal_chunk(100.0, 128, tau=512) == 512
    assert decode_maximal_chunk(2.0, 1, tau=512, min_chunk=1) == 2  # no decode slot: one


def test_the_measured_p_d_ratio_covers_the_last_finished_requests():
    pd = PDRatio(window=2)
    assert pd.value is None
    pd.finished(100, 10)
    pd.finished(50, 40)
    assert pd.value == 3.0
    pd.finished(30, 10)  # (100, 10) leaves the window
    assert pd.value == 1.6
    with pytest.raises(ConfigError):
        DecodeMaximalOptions(pd_window=0)


def test_golden_plans_one_prefill_chunk_beside_every_decode():
    sched = make("decode-maximal", budget=8, max_seqs=3, options={"min_chunk": 1})
    assert "decode-maximal" in COUPLED_POLICIES.names()
    for s in (seq("A", 6, 2), seq("B", 10, 3, first=20), seq("C", 9, 2, first=40)):
        sched.add(s)
    plans = []
    while sched.has_work:
        chunk = sched.chunk_size()
        plan = sched.schedule()
        plans.append((chunk, shape(plan)))
        step(sched, plan)
    assert plans == [
        (8, [("A", 0, 6, True)]),  # nothing finished yet: the chunk is tau
        (8, [("A", 6, 1, True), ("B", 0, 8, False)]),  # A ends: P:D = 6 / 2 = 3
        (6, [("B", 8, 2, True)]),  # chunk = 3 x (3 - 1) = 6
        (6, [("B", 10, 1, True), ("C", 0, 6, False)]),  # one chunk, B's decode beside it
        (6, [("B", 11, 1, True), ("C", 6, 3, True)]),  # B ends: P:D = 16 / 5, chunk 6
        (6, [("C", 9, 1, True)]),
    ]
    assert sched.chunk_size() == 7  # P:D = 25 / 7


def test_a_given_p_d_ratio_fixes_the_chunk():
    sched = make("decode-maximal", budget=64, max_seqs=5, options={"pd_ratio": 2.0,
                                                                   "min_chunk": 1})
    sched.add(seq("A", 20, 2))
    assert sched.chunk_size() == 8 and shape(sched.schedule()) == [("A", 0, 8, False)]


@pytest.mark.parametrize("host_blocks", [0, 8])
def test_every_request_completes_with_at_most_one_prefill_chunk_per_forward(host_blocks):
    rng = random.Random(host_blocks)
    sched = make("decode-maximal", budget=16, max_seqs=4, num_blocks=10,
                 host_blocks=host_blocks, options={"min_chunk": 2})
    wanted = add_random(sched, rng, 10, max_prompt=20, max_tokens=10, spacing=20)
    plans, finished = run_to_completion(sched)
    assert finished == wanted and sched.num_preemptions > 0
    assert (sum(len(p.swap_out) for p in plans) > 0) == bool(host_blocks)
    assert max(len(p.chunks) for p in plans) > 1  # decodes did ride along
    for plan in plans:  # a chunk of several tokens, or one that does not sample, is a prefill
        prefill_chunks = [c for c in plan.chunks if c.num_tokens > 1 or c.sampling is None]
        assert len(prefill_chunks) <= 1, shape(plan)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
