"""Whole runs: every request finishes with its output, no KV block is left held, runs repeat
exactly for a seed, and disaggregated, co-located and flipping clusters all complete."""

from __future__ import annotations

import pytest

from simulator.cluster import SimCluster
from simulator.run import simulate, without_wall_time
from simulator.workload import SyntheticShape, synthetic

from unit.simulator.sim_fixtures import COSTS, coupled, instance_config, layout

SHAPE = SyntheticShape(prompt_median=80, output_median=60, max_prompt_tokens=400,
                       max_output_tokens=200)


def requests(num=150, rate=20.0, seed=3):
    return synthetic(num, rate, seed, SHAPE)


def assert_conserved(cluster: SimCluster) -> None:
    for trace in cluster.traces.values():
        assert trace.error is None, trace.error
        assert len(trace.token_times) == trace.request.output_tokens
        assert list(trace.token_times) == sorted(trace.token_times)
    for inst in cluster.instances.values():
        assert not inst.role.live_seq_ids() and not inst.inbox and not inst.busy
        inst.kv.check_integrity(set())
        assert inst.kv.num_free_blocks == inst.kv.num_blocks


def run(lay, workload, seed=0) -> SimCluster:
    cluster = SimCluster(lay, COSTS, workload, seed)
    cluster.run()
    return cluster


def test_under_memory_pressure_every_request_finishes_and_every_block_comes_back():
    # 64 blocks of 16 tokens per instance: decodes are preempted and recomputed, prompts wait
    # for the prefill instance's leases to be released
    cluster = run(layout(1, 2, instance=instance_config(num_blocks=64)), requests())
    assert_conserved(cluster)
    assert sum(i.role.scheduler.num_preemptions for i in cluster.instances.values()
               if i.role.name == "decode") > 0
    assert cluster.transfer["count"] >= 150  # a recomputed sequence is not read again


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "chunked-only", "fastserve"])
def test_co_located_clusters_complete_and_conserve(policy):
    cluster = run(coupled(policy, num_blocks=64), requests(num=80))
    assert_conserved(cluster)
    assert cluster.transfer["count"] == 0


def test_a_seed_gives_the_same_report_and_another_seed_another():
    lay, workload = layout(1, 3), requests(num=120, rate=40.0)
    first = without_wall_time(simulate(lay, COSTS, workload, seed=7))
    assert without_wall_time(simulate(lay, COSTS, workload, seed=7)) == first
    other = without_wall_time(simulate(lay, COSTS, workload, seed=8))
    assert other["tbt_s"] != first["tbt_s"]  # power-of-two drew other pairs of decodes


def test_a_flipping_cluster_moves_an_instance_and_still_conserves():
    # three prefill instances and one decode instance under decode-heavy traffic: the
    # load-ratio policy moves prefill instances to the decode pool
    lay = layout(3, 1, flip_policy="load-ratio",
                 flip_options=(("cooldown_s", 1.0), ("sustain_ticks", 2.0), ("ratio", 2.0)))
    cluster = run(lay, synthetic(200, 15.0, 4, SyntheticShape(64, 0.5, 400, 0.5, 256, 400)))
    assert_conserved(cluster)
    assert cluster.flips and all(f["end_s"] is not None for f in cluster.flips)
    assert {(f["from"], f["to"]) for f in cluster.flips} == {("prefill", "decode")}
    roles = [i.role.name for i in cluster.instances.values()]
    assert roles.count("decode") == 1 + len(cluster.flips)


@pytest.mark.parametrize("steady", [True, False])
def test_a_migrating_flip_hands_the_decodes_on_and_still_conserves(steady):
    """decode-0 flips to prefill mid-run: draining by migration hands its sequences back to the
    gateway (each runs again from prompt + generated tokens), drains sooner than finishing them
    and still delivers every token of every request, with every block back."""
    from dataclasses import replace as replace_config

    from control_plane.transition import FlipDecision

    def run_flip(drain: str) -> SimCluster:
        base = instance_config()
        instance = replace_config(base, decode=replace_config(base.decode, flip_drain=drain))
        lay = replace_config(layout(1, 2, instance=instance), steady_decode=steady)
        cluster = SimCluster(lay, COSTS, requests(num=60, rate=10.0), 0)
        cluster.loop.at(3.0, cluster._flip, FlipDecision("decode-0", "prefill", "test"))
        cluster.run()
        return cluster

    finish, migrate = run_flip("finish"), run_flip("migrate")
    for cluster in (finish, migrate):
        assert_conserved(cluster)
        (flip,) = cluster.flips
        assert (flip["from"], flip["to"]) == ("decode", "prefill")
    assert finish.migrations == 0 and migrate.migrations > 0
    drain = {name: c.flips[0]["end_s"] - c.flips[0]["start_s"]
             for name, c in (("finish", finish), ("migrate", migrate))}
    assert drain["migrate"] < drain["finish"]  # simulated seconds, not wall time


def test_a_turn_overhead_delays_every_forward_but_adds_no_busy_time():
    """One request alone: every forward on its way (prefill chunks, decode steps) ends the
    overhead later, so its JCT grows by the overhead times the forwards, and busy time not."""
    from dataclasses import replace as replace_layout

    for steady in (True, False):
        lay = replace_layout(layout(1, 1), steady_decode=steady)
        plain = run(lay, requests(num=1))
        slow = run(replace_layout(lay, turn_overhead_s=0.005), requests(num=1))
        assert_conserved(slow)
        (before,), (after,) = plain.traces.values(), slow.traces.values()
        forwards = sum(i.num_forwards for i in slow.instances.values())
        assert forwards == sum(i.num_forwards for i in plain.instances.values()) > 10
        assert after.finish - before.finish == pytest.approx(0.005 * forwards)
        busy = [sum(i.busy_seconds for i in c.instances.values()) for c in (plain, slow)]
        assert busy[1] == pytest.approx(busy[0])
