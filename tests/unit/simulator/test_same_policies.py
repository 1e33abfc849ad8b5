"""The simulator runs the serving code's own policy classes: for the same command-line flags,
the objects a simulated instance (and gateway) holds are of the classes the real roles (and
gateway) load, with the same settings. Every registered name of every policy kind is tried, so
a new plug-in is covered the day it is registered."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from common.block_pool import KVCacheManager
from common.engine.kv_cache import KVLayout
from common.engine.role import RoleContext
from common.plugins import (
    ADMISSION_POLICIES,
    COUPLED_POLICIES,
    DISPATCH_POLICIES,
    FLIP_POLICIES,
    PREFILL_POLICIES,
    ROUTE_POLICIES,
)
from common.protocol import InstanceStats
from control_plane.cli import build_parser
from control_plane.cli_args import cluster_instance_config, gateway_config, instance_config
from control_plane.cluster import InstanceRegistry
from control_plane.routing import make_router
from control_plane.transition import make_watcher
from coupled_instance.role import CoupledRole
from decode_instance.role import DecodeRole
from prefill_instance.role import PrefillRole
from simulator.cluster import Layout, SimCluster
from simulator.fit import fit_profile

from unit.role_fixtures import FakeOutbox

NUM_BLOCKS, BLOCK_SIZE = 64, 16
COMMON = ["--chunk-size", "64", "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "10"]
PROFILE = {"model": "tiny", "dtype": "float32", "recommended_chunk_size": 64,
           "prefill": [{"tokens": 1, "seconds": 0.010}, {"tokens": 1000, "seconds": 0.1099}],
           "decode": [{"batch": 1, "step_seconds": 0.011}, {"batch": 10, "step_seconds": 0.020}]}


def real_role(role_cls, role: str, flags: list[str], cache_dir):
    """The real role on a fake context, from `splitserve instance` flags (a runner of model
    "tiny" whose profile record is in `cache_dir`, as the coupled role tests do)."""
    config = instance_config(build_parser().parse_args(
        ["instance", "--role", role, "--cache-dir", str(cache_dir), *COMMON, *flags]))
    runner = SimpleNamespace(max_model_len=4096, swap_space=None, device=torch.device("cpu"),
                             kv_layout=KVLayout(1, NUM_BLOCKS, BLOCK_SIZE, 1, 2, "float32"),
                             resolved=SimpleNamespace(name="tiny"), dtype_name="float32",
                             model=SimpleNamespace(shape=None))
    ctx = RoleContext(f"{role}-0", config, runner, KVCacheManager(NUM_BLOCKS, BLOCK_SIZE),
                      SimpleNamespace(endpoint="kv", poll=lambda: []), FakeOutbox(), "tcp://me")
    return role_cls(ctx)


def simulated(flags: list[str], cache_dir, coupled: bool = False) -> SimCluster:
    """A simulated cluster from the same flags given to `splitserve simulate`."""
    args = build_parser().parse_args(["simulate", "--cache-dir", str(cache_dir), *COMMON, *flags])
    layout = Layout(num_prefill=0 if coupled else 1, num_decode=0 if coupled else 1,
                    num_coupled=1 if coupled else 0, instance=cluster_instance_config(args),
                    gateway=gateway_config(args, 0))
    return SimCluster(layout, fit_profile(PROFILE, kv_bytes=1000), [])


@pytest.fixture
def cache_dir(tmp_path):
    record = {**PROFILE, "threads": torch.get_num_threads()}
    (tmp_path / "profile.json").write_text(json.dumps(record))
    return tmp_path


PREFILL_FLAGS = [["--prefill-policy", name] for name in PREFILL_POLICIES.names()] + \
    [["--dispatch-policy", name, "--predictor", "oracle"] for name in DISPATCH_POLICIES.names()]


@pytest.mark.parametrize("flags", PREFILL_FLAGS, ids=" ".join)
def test_prefill_instances_run_the_roles_scheduler_sort_key_dispatcher_and_predictor(
        flags, cache_dir):
    real = real_role(PrefillRole, "prefill", flags, cache_dir)
    sim = simulated(flags, cache_dir).instances["prefill-0"].role
    assert type(sim.scheduler) is type(real.scheduler)
    assert sim.scheduler.sort_key is real.scheduler.sort_key
    assert sim.scheduler.chunk_size == real.scheduler.chunk_size
    assert sim.scheduler.config == real.scheduler.config
    dispatcher = real.handoffs.dispatcher
    assert type(sim.dispatcher) is type(dispatcher)
    assert replace(sim.dispatcher.options, seed=None) == dispatcher.options  # seeded here
    assert type(sim.predictor) is type(real.predictor)
    assert sim.predictor.oracle == real.predictor.oracle


DECODE_FLAGS = [["--decode-admission", name, "--predictor", "oracle"]
                for name in ADMISSION_POLICIES.names()] + [["--decode-preempt", "swap"]]


@pytest.mark.parametrize("flags", DECODE_FLAGS, ids=" ".join)
def test_decode_instances_run_the_roles_scheduler_and_admission_policy(flags, cache_dir):
    real = real_role(DecodeRole, "decode", flags, cache_dir)
    sim = simulated(flags, cache_dir).instances["decode-0"].role
    assert type(sim.scheduler) is type(real.scheduler)
    assert sim.scheduler.batch == real.scheduler.batch
    assert type(sim.scheduler.swap) is type(real.scheduler.swap)
    if real.scheduler.swap is not None:
        assert sim.scheduler.swap.num_blocks == real.scheduler.swap.num_blocks
    assert type(sim.admission) is type(real.admission)
    assert sim.admission.prediction == real.admission.prediction == real.prediction


COUPLED_FLAGS = [["--policy", name] for name in COUPLED_POLICIES.names()] + [
    ["--policy", "fastserve", "--policy-option", "num_queues=4", "--swap-blocks", "32"],
    ["--policy", "sarathi", "--tbt-slo", "0.05"]]


@pytest.mark.parametrize("flags", COUPLED_FLAGS, ids=" ".join)
def test_co_located_instances_run_the_roles_policy_with_its_options_and_host_tier(
        flags, cache_dir):
    real = real_role(CoupledRole, "coupled", flags, cache_dir).scheduler
    sim = simulated(flags, cache_dir, coupled=True).instances["coupled-0"].role.scheduler
    assert type(sim) is type(real)
    assert sim.options == real.options
    assert (sim.swap is None) == (real.swap is None)
    if real.swap is not None:
        assert sim.swap.num_blocks == real.swap.num_blocks
    # the profiled costs reach the same policies (the simulator's from its cost model)
    assert type(sim.costs) is type(real.costs)
    if "--tbt-slo" not in flags:
        assert sim.batch == real.batch


GATEWAY_FLAGS = [["--route-policy", name, "--local-prefill", "on"]
                 for name in ROUTE_POLICIES.names()] + \
    [["--flip-policy", name] for name in FLIP_POLICIES.names()]


@pytest.mark.parametrize("flags", GATEWAY_FLAGS, ids=" ".join)
def test_the_gateway_runs_the_route_policy_and_transition_watcher_it_would_load(
        flags, cache_dir):
    args = build_parser().parse_args(["gateway", "--cache-dir", str(cache_dir), *flags])
    config = gateway_config(args, 0)
    router = make_router(InstanceRegistry(config.instance_timeout_s), config)
    watcher = make_watcher(config.flip_policy, **dict(config.flip_options))
    sim = simulated(flags, cache_dir)
    assert type(sim.router.policy) is type(router.policy)
    decode = InstanceStats("d0", "decode", "", "", PROFILE["model"], 4096, 100, 100,
                           dtype=PROFILE["dtype"], num_threads=torch.get_num_threads())
    assert sim.router.config == router.config
    assert sim.router.local_budget(decode) == router.local_budget(decode)
    assert type(sim.watcher.policy) is type(watcher.policy)
    assert vars(sim.watcher.policy) == vars(watcher.policy)
    assert (sim.watcher.cooldown_s, sim.watcher.sustain_ticks) == \
        (watcher.cooldown_s, watcher.sustain_ticks)
