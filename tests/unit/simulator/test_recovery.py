"""Recovered requests (migrated or refused) are routed as Gateway._recover routes them: without
the attempt's prefill and decode instances, anywhere when only they can take the request, and
not at all after max_recoveries or once the output reached max_tokens."""

from __future__ import annotations

from dataclasses import replace

from common.sequence import Sequence
from control_plane.transition import FlipDecision
from simulator.cluster import SimCluster, Trace
from simulator.workload import SimRequest, SyntheticShape, synthetic

from unit.simulator.sim_fixtures import COSTS, instance_config, layout

REQUEST = SimRequest("r0", 0.0, 40, 20, 20)
PROMPT = REQUEST.prompt_ids(0)


def held(num_prefill: int, num_decode: int, generated: int = 5, **gateway):
    """A cluster whose registry knows every instance (idle: ties go to the lowest id), with r0's
    attempt on prefill-0 and `generated` tokens streamed; sends are recorded, not delivered."""
    cluster = SimCluster(layout(num_prefill, num_decode, **gateway), COSTS, [REQUEST])
    for inst in cluster.instances.values():
        cluster.registry.report(inst.stats())
    trace = Trace(REQUEST, prefill_instance="prefill-0")
    trace.token_times.extend([0.1] * generated)
    cluster.traces["r0"] = trace
    seq = Sequence("r0", PROMPT, cluster.sampling(REQUEST), 4096)
    seq.token_ids += [3] * generated
    cluster.sent = []
    cluster.send = lambda target, kind, payload: cluster.sent.append((target, payload[1]))
    return cluster, trace, seq


def test_a_migrated_request_avoids_its_attempts_prefill_instance():
    # prefill-0 would win the tie: the old rule (only the draining decode excluded) sent it back
    cluster, trace, seq = held(2, 2)
    cluster.migrate(cluster.instances["decode-0"], seq)
    assert cluster.sent == [("prefill-1", PROMPT + [3] * 5)]
    assert trace.prefill_instance == "prefill-1" and trace.recoveries == 1
    assert trace.error is None and cluster.migrations == 1


def test_with_only_the_old_prefill_instance_left_a_migration_goes_back_to_it():
    cluster, trace, seq = held(1, 2)
    cluster.migrate(cluster.instances["decode-0"], seq)
    assert cluster.sent == [("prefill-0", PROMPT + [3] * 5)]
    assert trace.recoveries == 1 and trace.error is None


def test_a_refused_request_falls_back_to_the_refusing_instance_when_alone():
    # the gateway's second try has no exclusion; the old rule failed the request instead
    cluster, trace, _ = held(1, 1, generated=0)
    cluster.refused(cluster.instances["prefill-0"], (REQUEST, PROMPT, False))
    assert cluster.sent == [("prefill-0", PROMPT)]
    assert trace.recoveries == 1 and trace.error is None
    cluster, trace, _ = held(2, 1, generated=0)
    cluster.refused(cluster.instances["prefill-0"], (REQUEST, PROMPT, False))
    assert cluster.sent == [("prefill-1", PROMPT)]


def test_no_recovery_after_max_recoveries_or_a_complete_output():
    cluster, trace, seq = held(2, 2, max_recoveries=2)
    trace.recoveries = 2
    cluster.migrate(cluster.instances["decode-0"], seq)
    assert cluster.sent == [] and trace.error == "migrated from decode-0"
    assert trace.recoveries == 2  # a refused recovery is not counted, as in the gateway
    cluster, trace, seq = held(2, 2, generated=REQUEST.max_tokens)
    cluster.migrate(cluster.instances["decode-0"], seq)
    assert cluster.sent == [] and trace.error == "migrated from decode-0"


def test_a_migrating_flip_with_one_prefill_instance_still_completes_every_request():
    """decode-0 flips while prefill-0 is the only entry: every handed-back sequence runs again
    there (the fallback) and finishes with all its tokens."""
    base = instance_config()
    instance = replace(base, decode=replace(base.decode, flip_drain="migrate"))
    shape = SyntheticShape(prompt_median=80, output_median=60, max_prompt_tokens=400,
                           max_output_tokens=200)
    cluster = SimCluster(layout(1, 2, instance=instance), COSTS, synthetic(60, 10.0, 3, shape))
    cluster.loop.at(3.0, cluster._flip, FlipDecision("decode-0", "prefill", "test"))
    targets = []
    migrate = cluster.migrate

    def record(inst, seq):
        migrate(inst, seq)
        targets.append(cluster.traces[seq.seq_id].prefill_instance)
    cluster.migrate = record
    cluster.run()
    assert cluster.migrations > 0 and set(targets) == {"prefill-0"}
    for trace in cluster.traces.values():
        assert trace.error is None, trace.error
        assert len(trace.token_times) == trace.request.output_tokens
