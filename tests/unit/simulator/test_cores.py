"""Instances sharing a machine's cores (simulator/cores.py): a forward's end moves with the
share of a core it gets, the calibration reads the same model backwards, and a cluster whose
instances have a core each runs exactly as one without the model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.config import ConfigError
from common.plan import ForwardShape
from simulator.calibrate import charges, from_forwards
from simulator.cluster import SimCluster
from simulator.cores import SharedCores, work_seconds
from simulator.engine import EventLoop
from simulator.workload import SyntheticShape, synthetic

from unit.simulator.sim_fixtures import COSTS, layout

SHAPE = SyntheticShape(prompt_median=80, output_median=60, max_prompt_tokens=400,
                       max_output_tokens=200)


def run_jobs(cores: int, jobs: list[tuple[float, float]], threads: int = 1) -> list[float]:
    """jobs: (start, work seconds) -> each one's end time."""
    loop, ends = EventLoop(), [0.0] * len(jobs)
    shared = SharedCores(loop, cores, threads)
    for i, (start, work) in enumerate(jobs):
        def begin(i=i, work=work):
            shared.start(i, work, lambda wall, i=i: ends.__setitem__(i, loop.now))
        loop.at(start, begin)
    loop.run()
    return ends


def test_a_forward_alone_or_with_a_core_each_runs_at_full_speed():
    assert run_jobs(2, [(0.0, 1.0), (0.0, 1.0)]) == pytest.approx([1.0, 1.0])
    assert run_jobs(1, [(0.0, 1.0), (2.0, 0.5)]) == pytest.approx([1.0, 2.5])


def test_three_threads_on_two_cores_take_half_as_long_again():
    assert run_jobs(2, [(0.0, 1.0)] * 3) == pytest.approx([1.5] * 3)
    assert run_jobs(2, [(0.0, 1.0)], threads=4) == pytest.approx([2.0])


def test_a_forward_that_joins_slows_the_one_in_flight_from_then_on():
    # one core: A alone for 0.5 s (0.5 done), then both at half speed until A ends at 1.5 s
    # (B has done 0.5), then B alone for its last 0.5 s
    assert run_jobs(1, [(0.0, 1.0), (0.5, 1.0)]) == pytest.approx([1.5, 2.0])


def test_the_wall_time_handed_back_is_the_stretched_one():
    loop = EventLoop()
    shared, walls = SharedCores(loop, 1), {}
    for owner in ("a", "b"):
        shared.start(owner, 0.2, lambda wall, owner=owner: walls.__setitem__(owner, wall))
    loop.run()
    assert walls == pytest.approx({"a": 0.4, "b": 0.4})
    with pytest.raises(ValueError):
        SharedCores(loop, 0)


def line(begin: float, end: float, tokens: int = 1) -> dict:
    shape = ForwardShape(tokens=tokens, rows=tokens, context=0, pairs=0, fresh=(),
                         decodes=tokens, prompts=0)
    return {"time": end, "forward_s": end - begin, "turn_s": end - begin, "gap_s": 0.0,
            "shape": shape}


def test_work_seconds_reads_back_what_the_model_stretched():
    ends = run_jobs(2, [(0.0, 1.0), (0.2, 1.0), (0.4, 0.3), (3.0, 0.5)])
    lines = [line(s, e) for s, e in zip((0.0, 0.2, 0.4, 3.0), ends)]
    assert [x["forward_s"] for x in work_seconds(lines, 2)] == pytest.approx([1.0, 1.0, 0.3, 0.5])
    # two cores for two instances: nothing to share, the wall time is the work
    two = [line(0.0, 1.0), line(0.5, 1.2)]
    assert [x["forward_s"] for x in work_seconds(two, 2)] == pytest.approx([1.0, 0.7])


def test_the_calibration_measures_k_against_the_work_and_hands_the_sharing_on():
    lines = [line(0.0, 1.5, 4), line(0.0, 1.5, 4), line(0.0, 1.5, 4)]  # three on two cores
    price = COSTS.shape_s(lines[0]["shape"])
    shared = from_forwards(lines, COSTS, cores=2, threads=1)
    assert shared["factor"] == pytest.approx(1.0 / price)
    assert from_forwards(lines, COSTS)["factor"] == pytest.approx(1.5 / price)
    assert charges(shared)["shared_cores"] == 2 and charges(shared)["core_threads"] == 1
    assert charges({"factor": 1.0})["shared_cores"] is None  # a calibration from before


def times(cluster: SimCluster) -> list[float]:
    """Every request's token times and finish, in request order."""
    return [x for _, t in sorted(cluster.traces.items()) for x in (*t.token_times, t.finish)]


def simulate(lay) -> SimCluster:
    cluster = SimCluster(lay, COSTS, synthetic(60, 20.0, 3, SHAPE), 0)
    cluster.run()
    return cluster


def test_a_core_for_each_instance_changes_nothing_and_fewer_slow_every_forward():
    plain = simulate(layout(1, 2))
    own_cores = simulate(replace(layout(1, 2), shared_cores=3))
    assert len(times(plain)) > 1000 and times(own_cores) == pytest.approx(times(plain))
    one_core = simulate(replace(layout(1, 2), shared_cores=1))
    busy = sum(i.busy_seconds for i in one_core.instances.values())
    assert busy > 1.2 * sum(i.busy_seconds for i in plain.instances.values())
    assert sum(times(one_core)) > sum(times(plain))
    with pytest.raises(ConfigError):
        replace(layout(1, 2), shared_cores=0)
