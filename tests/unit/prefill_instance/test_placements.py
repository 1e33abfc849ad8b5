"""Golden placements from a current picture: scripted offers and views through the prefill
instance's hand-offs, with its own unreported placements added to the view."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from common.block_pool import KVCacheManager
from common.config import EngineConfig, PredictionConfig, PrefillConfig, TransferConfig
from common.engine.kv_cache import KVLayout
from common.engine.role import RoleContext
from common.plan import ModelOutput
from common.protocol import (
    ClusterView,
    GenerateRequest,
    KVTransferDone,
    KVTransferOffer,
    LengthPrediction,
    PeerInfo,
)
from common.sampling_params import SamplingParams
from common.transfer import TransferStatus
from prefill_instance.dispatcher import (
    DispatchOptions,
    LeastLoaded,
    PowerOfTwo,
    RandomChoice,
    RoundRobin,
)
from prefill_instance.placements import PendingPlacements, Placement
from prefill_instance.role import PrefillRole

from unit.role_fixtures import FakeOutbox

GATEWAY = "tcp://gateway"
BLOCK = 4
HEAVY = LengthPrediction(2, 400, 600)  # over the default threshold of 128 tokens


def make_role(dispatcher_cls=PowerOfTwo, seed=0) -> PrefillRole:
    config = SimpleNamespace(engine=EngineConfig(), transfer=TransferConfig(),
                             prefill=PrefillConfig(chunk_size=8, dispatch_policy="power_of_two"),
                             prediction=PredictionConfig())
    runner = SimpleNamespace(max_model_len=256, swap_space=None, device=torch.device("cpu"),
                             kv_layout=KVLayout(1, 64, BLOCK, 1, 2, "float32"))
    ctx = RoleContext("prefill-0", config, runner, KVCacheManager(64, BLOCK),
                      SimpleNamespace(endpoint="kv://prefill-0"), FakeOutbox(), "tcp://me")
    role = PrefillRole(ctx)
    role.handoffs.dispatcher = dispatcher_cls(DispatchOptions(block_size=BLOCK, seed=seed))
    return role


def peer(name, free=40, running=0, heavy=0, light=0, seen=0, at=0.0) -> PeerInfo:
    return PeerInfo(name, f"tcp://{name}", "", num_free_blocks=free, num_total_blocks=64,
                    num_running=running, num_heavy=heavy, num_light=light,
                    offers_seen={"prefill-0": seen} if seen else {}, report_time=at)


def prefill(role, request_id, prediction=None):
    """A 5-token prompt prefilled in one forward: its first token makes 6 tokens, and the
    decode instance will take ceil((6 + 1) / 4) = 2 blocks for it."""
    role.handle(GenerateRequest(request_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=8),
                                GATEWAY, time.time()))
    role.scheduler.get(request_id).meta.prediction = prediction  # as a predictor would set it
    plan = role.schedule()
    role.update_from_output(plan, ModelOutput(
        {c.seq_id: 9 for c in plan.chunks if c.sampling is not None}))


def offers(role) -> list[KVTransferOffer]:
    return [m for _, m in role.ctx.outbox.sent if isinstance(m, KVTransferOffer)]


def targets(role) -> list[str]:
    return [address.removeprefix("tcp://") for address, m in role.ctx.outbox.sent
            if isinstance(m, KVTransferOffer)]


def burst(role, n, start=0):
    for i in range(start, start + n):
        prefill(role, f"r{i}")


def test_a_burst_between_two_views_splits_evenly_with_power_of_two():
    role = make_role(PowerOfTwo)
    role.handle(ClusterView([peer("d0"), peer("d1")]))
    burst(role, 8)
    # without the pending count all 8 would see the same two empty instances; with it each
    # placement makes its instance the busier one for the next, and only the exact ties (equal
    # counts) fall to the seeded sampling order
    got = targets(role)
    assert got == ["d1", "d0", "d1", "d0", "d1", "d0", "d0", "d1"]
    assert all(sorted(got[i:i + 2]) == ["d0", "d1"] for i in range(0, 8, 2))
    placements = role.handoffs.placements
    assert placements.counts("d0") == (4, 0, 8) and placements.counts("d1") == (4, 0, 8)


def test_a_burst_fills_the_idle_instance_up_to_the_busy_one_and_then_alternates():
    role = make_role(PowerOfTwo)
    role.handle(ClusterView([peer("d0", running=3, light=3, free=30), peer("d1", free=40)]))
    burst(role, 8)
    # d1 takes three (each one more decode there); from then on at equal counts the roomier
    # one (d1: 40 - 2 per placement against d0's 30), otherwise the one with fewer decodes
    assert targets(role) == ["d1", "d1", "d1", "d1", "d0", "d1", "d0", "d1"]
    final = {d.instance_id: role.handoffs.placements.adjusted(d).num_running
             for d in role.handoffs.decodes}
    assert final == {"d0": 5, "d1": 6}
    # the stale picture alone would have sent all eight to d1
    raw = PowerOfTwo(DispatchOptions(block_size=BLOCK, seed=0))
    seq = role.handoffs.leases["r0"].seq
    assert {raw.pick(seq, role.handoffs.decodes).instance_id for _ in range(8)} == {"d1"}


def test_least_loaded_sees_the_blocks_its_own_placements_will_take():
    role = make_role(LeastLoaded)
    role.handle(ClusterView([peer("d0", free=10), peer("d1", free=7)]))
    burst(role, 4)
    # d0 10 -> 8 -> 6 free; d1 7 -> 5: the free-block picture moves with every offer
    assert targets(role) == ["d0", "d0", "d1", "d0"]


def test_random_with_a_seed_gives_the_exact_sequence_and_ignores_loads():
    role = make_role(RandomChoice, seed=7)
    role.handle(ClusterView([peer("d1"), peer("d0", running=9)]))
    burst(role, 8)
    assert targets(role) == ["d1", "d0", "d1", "d0", "d0", "d0", "d1", "d0"]
    rr = make_role(RoundRobin)
    rr.handle(ClusterView([peer("d1"), peer("d0")]))
    burst(rr, 4)
    assert targets(rr) == ["d0", "d1", "d0", "d1"]


def test_pending_counts_clear_exactly_when_the_report_acknowledges_the_offer():
    role = make_role(PowerOfTwo)
    role.handle(ClusterView([peer("d0"), peer("d1")]))
    burst(role, 4)  # d1, d0, d1, d0
    numbers = [o.offer_number for o in offers(role)]
    assert numbers == sorted(numbers) and len(set(numbers)) == 4
    pending = role.handoffs.placements
    # d0 reports having received its first offer (numbers[1]) and holding it: one left pending
    role.handle(ClusterView([peer("d0", running=1, light=1, free=38, seen=numbers[1], at=1.0),
                             peer("d1", at=1.0)]))
    assert pending.counts("d0") == (1, 0, 2) and pending.counts("d1") == (2, 0, 4)
    seen = {p.instance_id: p for p in role.handoffs.decodes}
    adjusted = pending.adjusted(seen["d0"])
    assert (adjusted.num_running, adjusted.num_light, adjusted.num_free_blocks) == (2, 2, 36)
    # a report older than the one taken does not move the picture back (nor the counts)
    role.handle(ClusterView([peer("d0", at=0.5), peer("d1", at=1.0)]))
    assert pending.counts("d0") == (1, 0, 2)
    assert {p.instance_id: p.num_running for p in role.handoffs.decodes} == {"d0": 1, "d1": 0}
    # the next reports show every offer: nothing is added twice
    role.handle(ClusterView([peer("d0", running=2, seen=numbers[3], at=2.0),
                             peer("d1", running=2, seen=numbers[2], at=2.0)]))
    assert pending.counts("d0") == (0, 0, 0) and pending.counts("d1") == (0, 0, 0)
    assert pending.adjusted(role.handoffs.decodes[0]) is role.handoffs.decodes[0]


def test_an_acknowledgement_of_a_later_offer_covers_the_earlier_ones_in_flight():
    placements = PendingPlacements("p")
    for number, request in ((10, "a"), (12, "b"), (15, "c")):
        placements.placed("d0", request, Placement(number, heavy=request == "b", blocks=3))
    assert placements.counts("d0") == (3, 1, 9)
    placements.see([PeerInfo("d0", "", "", offers_seen={"p": 12, "other": 99})])
    assert placements.counts("d0") == (1, 0, 3)  # only c (15) is still unreported
    placements.see([PeerInfo("d0", "", "", offers_seen={"p": 14})])  # nothing new
    assert placements.counts("d0") == (1, 0, 3)


def test_heavy_and_light_count_by_the_prediction_the_offer_carries():
    placements = PendingPlacements("p")
    placements.placed("d0", "h", Placement(1, heavy=True, blocks=5))
    placements.placed("d0", "l", Placement(2, heavy=False, blocks=1))
    adjusted = placements.adjusted(PeerInfo("d0", "", "", num_free_blocks=4, num_running=1,
                                            num_heavy=1))
    assert (adjusted.num_free_blocks, adjusted.num_running, adjusted.num_heavy,
            adjusted.num_light) == (0, 3, 2, 1)


def test_refused_dead_absent_and_expired_placements_are_dropped():
    role = make_role(RoundRobin)
    role.handle(ClusterView([peer("d0"), peer("d1")]))
    burst(role, 4)  # d0, d1, d0, d1
    pending = role.handoffs.placements
    role.handle(KVTransferDone("r0", TransferStatus.REJECTED, "draining"))
    assert pending.counts("d0") == (0, 0, 0)  # d0 drains: none of our offers count there
    role.handle(ClusterView([peer("d1")], dead=[]))  # d0 no longer listed
    assert pending.counts("d1") == (2, 0, 4)
    role.handle(ClusterView([peer("d1")], dead=["d1"]))
    assert pending.counts("d1") == (0, 0, 0)
    role.handle(ClusterView([peer("d2")]))
    role.poll()  # r0, refused by d0, goes to d2
    prefill(role, "late")
    assert pending.counts("d2") == (2, 0, 4)
    role.handoffs.leases["late"].expires = 0.0
    role.poll()  # its lease expired: the decode instance drops the offer too
    assert pending.counts("d2") == (1, 0, 2)


def test_no_placement_from_a_view_sent_while_the_cluster_starts():
    role = make_role(RandomChoice, seed=3)
    role.handle(ClusterView([peer("d0")], complete=False))  # d1 has not reported yet
    burst(role, 2)
    assert targets(role) == [] and len(role.handoffs.undispatched) == 2
    role.handle(ClusterView([peer("d0"), peer("d1")]))
    role.poll()  # the held sequences go out over both instances
    assert targets(role) == ["d0", "d0"]
    burst(role, 6, start=2)
    assert targets(role) == ["d0", "d0", "d1", "d1", "d0", "d0", "d1", "d1"]


def test_a_heavy_prediction_counts_as_a_heavy_placement():
    role = make_role(PowerOfTwo)
    role.handle(ClusterView([peer("d0"), peer("d1")]))
    prefill(role, "h", prediction=HEAVY)
    (target,) = targets(role)
    assert role.handoffs.placements.counts(target) == (1, 1, 2)
