"""The steady-decode fast path (simulator/steady.py) changes nothing but the speed: whole runs
with it on and off give the same traces (every token's time), reports, preemptions and flips,
across the states it must hand back to the scheduler (admission, preemption and recompute,
swap, prefix caching, reserve admission with predictions, flips, local prefill)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.block_pool import KVCacheManager
from common.config import BatchConfig, DecodeConfig, PredictionConfig
from common.sampling_params import SamplingParams
from common.sequence import Sequence
from decode_instance.scheduler import DecodeScheduler
from simulator.cluster import SimCluster
from simulator.run import report, without_wall_time
from simulator.steady import steady_batch
from simulator.workload import SyntheticShape, synthetic

from unit.simulator.sim_fixtures import COSTS, instance_config, layout

SHAPE = SyntheticShape(prompt_median=80, output_median=60, max_prompt_tokens=400,
                       max_output_tokens=200)
ORACLE = PredictionConfig(predictor="oracle", oracle_granularity=50, heavy_threshold=60)

CASES = {
    "1P2D": layout(1, 2),
    "memory pressure (recompute)": layout(1, 2, instance=instance_config(num_blocks=64)),
    "memory pressure (swap)": layout(1, 2, instance=instance_config(
        num_blocks=64, decode=DecodeConfig(preempt="swap"))),
    "no prefix caching": layout(1, 2, instance=replace(instance_config(), engine=replace(
        instance_config().engine, cache=replace(instance_config().engine.cache,
                                                prefix_caching=False)))),
    "reserve-dynamic, oracle": layout(1, 2, instance=instance_config(
        num_blocks=96, decode=DecodeConfig(admission="reserve-dynamic"), prediction=ORACLE)),
    "wake-up": replace(layout(1, 2), wake_s=0.004),
    "flips": layout(3, 1, flip_policy="load-ratio", flip_options=(
        ("cooldown_s", 1.0), ("sustain_ticks", 2.0), ("ratio", 2.0))),
}


def run(lay, steady: bool, seed: int = 0, leap_steps: int = 64) -> SimCluster:
    cluster = SimCluster(replace(lay, steady_decode=steady, leap_steps=leap_steps), COSTS,
                         synthetic(150, 20.0, 3, SHAPE), seed)
    cluster.run()
    return cluster


def without_events(result: dict) -> dict:
    return {**result, "simulation": {k: v for k, v in result["simulation"].items()
                                     if k != "events"}}


def fingerprint(cluster: SimCluster) -> dict:
    decodes = [i for i in cluster.instances.values() if isinstance(i.role.scheduler,
                                                                   DecodeScheduler)]
    return {
        "traces": {k: (list(t.token_times), t.finish, t.error)
                   for k, t in cluster.traces.items()},
        # a leap is one event for many forwards: the event count is all that may differ
        "report": without_events(without_wall_time(report(cluster, 1.0, 1.0))),
        "flips": cluster.flips,
        "preemptions": [i.role.scheduler.num_preemptions for i in decodes],
        "busy": [(i.instance_id, i.busy_seconds, i.num_forwards, i.computed_tokens)
                 for i in cluster.instances.values()],
        # the order blocks went back to the pool: any change in the order of its calls shows
        "free_lists": [(list(i.kv.pool._free), list(i.kv.pool._free_cached))
                       for i in cluster.instances.values()],
    }


@pytest.mark.parametrize("leap_steps", [1, 64])
@pytest.mark.parametrize("name", list(CASES))
def test_the_fast_path_gives_the_same_run(name, leap_steps, monkeypatch):
    from simulator import steady
    forwards = []
    real = steady.absorb_window
    monkeypatch.setattr(steady, "absorb_window", lambda *a: (forwards.append(1), real(*a))[1])
    fast = run(CASES[name], True, leap_steps=leap_steps)
    assert forwards, "the fast path never ran: the comparison proves nothing"
    slow = run(CASES[name], False)
    assert fingerprint(fast) == fingerprint(slow)
    if leap_steps > 1:  # forwards were planned several at a time
        assert fast.loop.num_events < slow.loop.num_events


def test_pressure_cases_reach_the_states_the_fast_path_hands_back():
    cluster = run(CASES["memory pressure (recompute)"], True)
    assert sum(i.role.scheduler.num_preemptions for i in cluster.instances.values()
               if i.role.name == "decode") > 0
    assert run(CASES["flips"], True).flips


def _scheduler(num_blocks: int = 8) -> DecodeScheduler:
    """Two running decodes of 17 and 33 tokens whose tables cover the 16 and 32 tokens computed:
    each needs one more block (16 tokens a block) for its next token."""
    scheduler = DecodeScheduler(BatchConfig(max_num_seqs=8, max_num_batched_tokens=64),
                                KVCacheManager(num_blocks, 16))
    for seq_id, length in (("a", 17), ("b", 33)):
        seq = Sequence(seq_id, list(range(length)), SamplingParams(max_tokens=8), 4096,
                       arrival_time=0.0)
        scheduler.kv.grow(seq_id, length - 1)
        seq.num_computed_tokens = length - 1
        scheduler.add_prefilled(seq)
    return scheduler


def test_steady_only_where_the_plan_can_only_be_one_token_each():
    scheduler = _scheduler()
    planned = _scheduler()
    plan = planned.schedule()  # what the real planner makes of that state
    assert [(c.seq_id, c.num_tokens, c.sampling is not None) for c in plan.chunks] == \
        [("a", 1, True), ("b", 1, True)]
    batch, context = steady_batch(scheduler)
    assert [s.seq_id for s in batch] == ["a", "b"] and context == 16 + 32
    assert {s: scheduler.kv.table(s) for s in "ab"} == {c.seq_id: c.block_ids for c in plan.chunks}

    waiting = _scheduler()
    waiting.add(Sequence("c", [1, 2, 3], SamplingParams(), 4096, arrival_time=0.0))
    assert steady_batch(waiting) is None

    recomputing = _scheduler()
    recomputing.running[1].num_computed_tokens = 0
    assert steady_batch(recomputing) is None

    short = _scheduler(num_blocks=4)  # 3 held; a and b need one more each: one would preempt
    assert short.kv.num_free_blocks == 1 and steady_batch(short) is None
    assert short.kv.num_free_blocks == 1  # refused without growing anything
    assert steady_batch(_scheduler(num_blocks=5)) is not None

    over_budget = _scheduler()
    over_budget.batch = BatchConfig(max_num_seqs=8, max_num_batched_tokens=1)
    assert steady_batch(over_budget) is None


@pytest.mark.parametrize("name", ["1P2D", "memory pressure (swap)", "flips"])
def test_recorded_forwards_are_the_same_with_the_fast_path_and_add_up_to_the_counters(name):
    """Layout.record_forwards: a leap records each of its forwards as the planned loop does (the
    shape forward_check prices and classes), and the records add up to the busy counters."""
    lay = replace(CASES[name], record_forwards=True)
    fast, slow = run(lay, True), run(lay, False)
    for cluster in (fast, slow):
        for inst in cluster.instances.values():
            assert len(inst.forwards) == inst.num_forwards
            assert sum(s for _, s in inst.forwards) == pytest.approx(inst.busy_seconds)
            # each forward's recorded seconds are what the cost model says for its shape
            assert all(s == pytest.approx(COSTS.shape_s(shape)) for shape, s in inst.forwards
                       if not shape.swap_blocks)
    assert {k: i.forwards for k, i in fast.instances.items()} == \
        {k: i.forwards for k, i in slow.instances.items()}
    assert any(shape.kind == "decode" and shape.decodes > 1
               for i in fast.instances.values() for shape, _ in i.forwards)
