"""The simulated gateway counts what it sent an instance until a report has seen it (the echo,
`InstanceStats.requests_seen`), as the real gateway does: a request waiting in a busy
instance's inbox still counts there, so the next one goes to the other instance."""

from __future__ import annotations

from dataclasses import replace

from simulator.cluster import SimCluster
from simulator.workload import SimRequest

from unit.simulator.sim_fixtures import COSTS, coupled

# A 500-token forward takes about 0.5 s: several monitor ticks (every 0.1 s) while it runs.
SLOW = replace(COSTS, base=((1, 0.010), (1001, 1.0)))


def test_a_request_in_a_busy_instances_inbox_still_counts():
    requests = [SimRequest("A", 0.00, 500, 4, 4), SimRequest("B", 0.01, 500, 4, 4),
                SimRequest("C", 0.02, 100, 4, 4),  # a tie (500 each): c0, behind A's forward
                SimRequest("D", 0.15, 100, 4, 4)]  # after a tick's reports, A still running
    cluster = SimCluster(coupled("vllm"), SLOW, requests, seed=0)
    cluster.run()
    assert all(t.error is None for t in cluster.traces.values())
    seen = sorted(inst.requests_seen for inst in cluster.instances.values())
    # Without the echo the tick's reports cleared C from the count: c0 looked like 500 beside
    # c1's 500, and the tie sent D behind A and C as well (3 and 1).
    assert seen == [2, 2]
