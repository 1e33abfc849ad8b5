"""Plug-in registries (common.plugins): every entry point loads what its kind promises, and a new
policy is one class plus one registration, which the CLI and the schedulers take unchanged."""

from __future__ import annotations

import pytest

from common.block_pool import KVCacheManager
from common.config import BatchConfig
from common.engine.role import Role
from common.plan import BatchPlan, ModelOutput
from common.plugins import (
    ADMISSION_POLICIES,
    COUPLED_POLICIES,
    DISPATCH_POLICIES,
    FLIP_POLICIES,
    PREDICTORS,
    PREFILL_POLICIES,
    REGISTRIES,
    ROLES,
    ROUTE_POLICIES,
)
from common.protocol import PeerInfo
from common.sampling_params import SamplingParams
from common.schedulers.base import PlanBuilder
from common.schedulers.coupled import CoupledScheduler, make_coupled_scheduler
from common.sequence import Sequence
from common.transfer import BACKENDS, KVTransferBackend
from control_plane.cli import build_parser
from control_plane.cli_args import cluster_instance_config
from control_plane.routing import RoutePolicy
from control_plane.transition import FlipPolicy
from decode_instance.admission import AdmissionPolicy
from length_predictor.base import LengthPredictor
from prefill_instance.dispatcher import Dispatcher, DispatchOptions

KINDS = [(ROLES, Role), (BACKENDS, KVTransferBackend), (COUPLED_POLICIES, CoupledScheduler),
         (DISPATCH_POLICIES, Dispatcher), (ADMISSION_POLICIES, AdmissionPolicy),
         (FLIP_POLICIES, FlipPolicy), (PREDICTORS, LengthPredictor),
         (ROUTE_POLICIES, RoutePolicy)]


@pytest.mark.parametrize("registry, base", KINDS, ids=[r.kind for r, _ in KINDS])
def test_every_entry_point_loads_an_implementation_of_its_kind(registry, base):
    loaded = registry.load_all()
    assert loaded and all(issubclass(cls, base) for cls in loaded.values()), loaded


def test_prefill_policies_are_sort_keys():
    seq = Sequence("s", [1, 2, 3], SamplingParams(), max_model_len=10, arrival_time=1.0)
    assert {name: key(seq) for name, key in PREFILL_POLICIES.items()} == \
        {"fcfs": 1.0, "sjf": (3, 1.0), "ljf": (-3, 1.0)}
    assert set(REGISTRIES.values()) == {*(r for r, _ in KINDS), PREFILL_POLICIES}


# -- a new policy, written here and registered by a test instead of an entry point ---------------
class PromptsFirst(CoupledScheduler):
    """A throwaway co-located policy: new prompts (chunked) before running decodes."""

    def schedule(self) -> BatchPlan:
        plan = PlanBuilder()
        budget = self._admit_chunked(plan, self.batch.max_num_batched_tokens)
        admitted = plan.seq_ids
        self._continue(plan, [s for s in self.running if s.seq_id not in admitted], budget)
        return plan.build()


class FirstPeer(Dispatcher):
    """A throwaway dispatch policy: the decode instance first by id."""

    def pick(self, seq, decodes):
        return min(decodes, key=lambda p: p.instance_id, default=None)


@pytest.fixture
def throwaway(request):
    """Registers `request.param` = (registry, name, implementation) for one test."""
    registry, name, implementation = request.param
    registry.register(name)(implementation)
    yield name
    registry.unregister(name)


@pytest.mark.parametrize("throwaway", [(COUPLED_POLICIES, "prompts-first", PromptsFirst)],
                         indirect=True)
def test_a_new_coupled_policy_runs_through_the_cli_and_a_scheduler(throwaway):
    args = build_parser().parse_args(["up", "--prefill", "0", "--decode", "0", "--coupled", "1",
                                      "--policy", throwaway])
    assert cluster_instance_config(args).coupled_policy == "prompts-first"
    sched = make_coupled_scheduler(throwaway, BatchConfig(max_num_seqs=4,
                                                          max_num_batched_tokens=6),
                                   KVCacheManager(16, 4))
    sched.add(Sequence("a", [1, 2, 3], SamplingParams(max_tokens=3), max_model_len=100))
    sched.add(Sequence("b", [4, 5, 6, 7, 8], SamplingParams(max_tokens=2), max_model_len=100))
    shapes = []
    while sched.has_work:
        plan = sched.schedule()
        shapes.append([(c.seq_id, c.num_cached, c.num_tokens) for c in plan.chunks])
        sched.update_from_output(plan, ModelOutput({c.seq_id: 9 for c in plan.chunks
                                                    if c.sampling is not None}))
    assert shapes == [[("a", 0, 3), ("b", 0, 3)], [("a", 3, 1), ("b", 3, 2)],
                      [("a", 4, 1), ("b", 5, 1)]]
    sched.check_integrity()


@pytest.mark.parametrize("throwaway", [(DISPATCH_POLICIES, "first-peer", FirstPeer)],
                         indirect=True)
def test_a_new_dispatch_policy_runs_through_the_cli_and_the_registry(throwaway):
    args = build_parser().parse_args(["up", "--dispatch-policy", throwaway])
    assert cluster_instance_config(args).prefill.dispatch_policy == "first-peer"
    dispatcher = DISPATCH_POLICIES.get(throwaway)(DispatchOptions())
    peers = [PeerInfo(i, f"tcp://{i}:1", f"tcp://{i}:2") for i in ("d2", "d1")]
    seq = Sequence("s", [1], SamplingParams(), max_model_len=10)
    assert dispatcher.pick(seq, peers).instance_id == "d1"


PLUGIN_FLAGS = [("up", "--policy", COUPLED_POLICIES), ("up", "--prefill-policy", PREFILL_POLICIES),
                ("up", "--dispatch-policy", DISPATCH_POLICIES),
                ("up", "--decode-admission", ADMISSION_POLICIES),
                ("up", "--flip-policy", FLIP_POLICIES), ("up", "--transfer", BACKENDS),
                ("up", "--route-policy", ROUTE_POLICIES),
                ("instance", "--role", ROLES)]


@pytest.mark.parametrize("command, flag, registry", PLUGIN_FLAGS,
                         ids=[flag for _, flag, _ in PLUGIN_FLAGS])
def test_plug_in_flags_take_any_registered_name_and_list_them(command, flag, registry, capsys):
    registry.register("throwaway")(object)
    try:
        args = build_parser().parse_args([command, flag, "throwaway"])
        assert "throwaway" in vars(args).values()
    finally:
        registry.unregister("throwaway")
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, flag, "throwaway"])
    error = capsys.readouterr().err
    assert "invalid choice: 'throwaway'" in error
    assert all(repr(name) in error for name in registry.names())
    assert error.count("\n") == 1 and error.startswith(f"splitserve {command}: error:"), error
