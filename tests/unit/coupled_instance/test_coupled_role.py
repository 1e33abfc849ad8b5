"""The coupled role on a fake RoleContext: admit, stream, abort, deadlines, drain, host tier."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from common.block_pool import KVCacheManager
from common.config import BatchConfig, ConfigError, EngineConfig
from common.engine.kv_cache import KVLayout
from common.engine.role import RoleContext
from common.protocol import AbortRequest, GenerateRequest, KVTransferDone, KVTransferOffer
from common.sampling_params import SamplingParams
from common.transfer import TransferStatus
from coupled_instance.role import CoupledRole, CoupledSettings

from unit.role_fixtures import FakeOutbox, run_turn

GATEWAY = "tcp://gateway"
REJECTED = TransferStatus.REJECTED  # a rejection's error text starts with its status


def make_role(policy="vllm", num_blocks=32, block_size=4, **settings):
    fields = {"coupled_swap_blocks": None, "coupled_swap_bandwidth": None,
              "coupled_options": (), **settings}
    config = SimpleNamespace(engine=EngineConfig(batch=BatchConfig(max_num_seqs=4,
                                                                   max_num_batched_tokens=16)),
                             coupled_policy=policy, **fields)
    runner = SimpleNamespace(max_model_len=256, swap_space=None, device=torch.device("cpu"),
                             kv_layout=KVLayout(1, num_blocks, block_size, 1, 2, "float32"))
    ctx = RoleContext("coupled-0", config, runner, KVCacheManager(num_blocks, block_size),
                      None, FakeOutbox(), "tcp://me")
    return CoupledRole(ctx)


def request(request_id, num_prompt=5, max_tokens=3, deadline=0.0, num_generated=0):
    return GenerateRequest(request_id, list(range(1, num_prompt + 1)),
                           SamplingParams(max_tokens=max_tokens), GATEWAY, time.time(),
                           deadline=deadline, num_generated=num_generated)


def turn(role, token=9):
    """One instance-loop turn with a fake forward; returns the updates emitted."""
    return [(u.request_id, u.token_ids, u.finish_reason, u.num_output_tokens)
            for u in run_turn(role, GATEWAY, token)]


def test_requests_are_served_end_to_end_and_their_blocks_freed():
    role = make_role("vllm")
    role.handle(request("a"))
    role.handle(request("b", num_prompt=7))
    assert role.load() == {"num_waiting": 2, "num_running": 0, "num_transferring": 0,
                           "num_queued_tokens": 12,
                           "policy_counters": {"preemptions": 0, "recomputes": 0,
                                               "swap_outs": 0, "swap_ins": 0,
                                               "blocks_swapped_out": 0,
                                               "blocks_swapped_in": 0}}
    assert turn(role) == [("a", [9], None, 1), ("b", [9], None, 1)]
    assert turn(role) == [("a", [9], None, 2), ("b", [9], None, 2)]
    assert turn(role) == [("a", [9], "length", 3), ("b", [9], "length", 3)]
    assert not role.has_work and role.is_drained and role.live_seq_ids() == set()
    assert role.ctx.kv.num_free_blocks == role.ctx.kv.num_blocks


def test_abort_and_deadline_free_the_sequence():
    role = make_role("sarathi")
    role.handle(request("a", max_tokens=10))
    role.handle(request("late", max_tokens=10, deadline=time.time() + 60))
    turn(role)
    role.handle(AbortRequest("a"))
    role.scheduler.sequences["late"].meta.deadline = time.time() - 1
    updates = turn(role)
    assert updates == [("late", [], "error", 1)]
    assert role.ctx.kv.num_free_blocks == role.ctx.kv.num_blocks and not role.has_work


def test_a_recovered_request_counts_its_generated_tokens_as_output():
    role = make_role("orca")
    role.handle(request("r", num_prompt=6, max_tokens=3, num_generated=2))
    assert turn(role) == [("r", [9], "length", 3)]  # 2 already streamed + 1 = max_tokens


def test_draining_sends_unstarted_requests_back_and_finishes_the_rest():
    role = make_role("vllm")
    role.handle(request("started", max_tokens=2))
    turn(role)
    role.handle(request("queued"))
    role.begin_drain()
    role.handle(request("new"))
    bounced = role.ctx.pending_tokens.pop(GATEWAY)
    assert [(u.request_id, u.recoverable) for u in bounced] == [("queued", True), ("new", True)]
    assert not role.is_drained
    assert turn(role) == [("started", [9], "length", 2)]
    assert role.is_drained


def test_kv_offers_are_rejected_so_the_prefill_instance_looks_elsewhere():
    role = make_role()
    offer = KVTransferOffer("x", [1, 2], 1, SamplingParams(), GATEWAY, "p0", "tcp://p0", "kv", [0],
                            1, time.time() + 5)
    role.handle(offer)
    (address, done), = role.ctx.outbox.sent
    assert address == "tcp://p0" and isinstance(done, KVTransferDone)
    assert not done.ok and done.error.startswith(REJECTED)
    assert done.status is TransferStatus.REJECTED


def test_fastserve_gets_a_host_tier_by_default_and_others_on_request():
    role = make_role("fastserve", num_blocks=16)
    assert role.scheduler.swap.num_blocks == 16
    assert role.ctx.runner.swap_space.num_blocks == 16
    assert make_role("sarathi").scheduler.swap is None
    role = make_role("sarathi", coupled_swap_blocks=8, coupled_swap_bandwidth=1e9)
    assert role.scheduler.swap.num_blocks == 8
    assert role.ctx.runner.swap_space.bandwidth_bytes_per_s == 1e9


def test_policy_options_reach_the_policy_and_bad_names_fail():
    role = make_role("fastserve", coupled_options=(("starvation_limit_s", 2.5),
                                                   ("num_queues", 3.0), ("proactive", 0.0)))
    assert role.scheduler.mlfq.starvation_limit_s == 2.5
    assert role.scheduler.mlfq.num_queues == 3 and role.scheduler.options.proactive is False
    with pytest.raises(ValueError, match="unknown fastserve options"):
        make_role("fastserve", coupled_options=(("quantum", 1.0),))
    with pytest.raises(KeyError, match="known: chunked-only"):
        make_role("nope")
    from common.config import InstanceConfig

    assert CoupledSettings.from_config(InstanceConfig()).policy == "sarathi"


# -- forward costs from the profile: FastServe's job profiler, the budget from a TBT SLO ---------
PROFILE = {"model": "tiny", "dtype": "float32", "threads": torch.get_num_threads(),
           "recommended_chunk_size": 64,
           "prefill": [{"tokens": 1, "seconds": 0.010}, {"tokens": 1000, "seconds": 0.1099}],
           "decode": [{"batch": 1, "step_seconds": 0.011}, {"batch": 10, "step_seconds": 0.020}]}


def role_from_flags(tmp_path, *flags):
    """A coupled role built from `splitserve instance` flags, on a fake runner of model "tiny"
    whose `splitserve profile` record is in the cache directory."""
    import json

    from control_plane.cli import build_parser
    from control_plane.cli_args import instance_config

    # the thread count now: other tests may have changed it since import, and a record made
    # with another count is not used
    record = {**PROFILE, "threads": torch.get_num_threads()}
    (tmp_path / "profile.json").write_text(json.dumps(record))
    config = instance_config(build_parser().parse_args(
        ["instance", "--role", "coupled", "--cache-dir", str(tmp_path), "--max-num-seqs", "10",
         *flags]))
    runner = SimpleNamespace(max_model_len=256, swap_space=None, device=torch.device("cpu"),
                             kv_layout=KVLayout(1, 32, 4, 1, 2, "float32"),
                             resolved=SimpleNamespace(name="tiny"), dtype_name="float32")
    ctx = RoleContext("coupled-0", config, runner, KVCacheManager(32, 4), None, FakeOutbox(),
                      "tcp://me")
    return config, CoupledRole(ctx)


def test_the_tbt_slo_flag_sets_the_policys_token_budget_from_the_profile(tmp_path):
    config, role = role_from_flags(tmp_path, "--policy", "sarathi", "--tbt-slo", "0.05005")
    assert config.coupled_tbt_slo_s == 0.05005
    # 0.010 + 0.0001 (T - 1) + 0.0091 (10 decodes' extra) <= 0.05005 s: T = 310
    assert role.scheduler.batch.max_num_batched_tokens == 310
    _, role = role_from_flags(tmp_path, "--policy", "sarathi")
    assert role.scheduler.batch.max_num_batched_tokens == 512  # no SLO: the flag's budget
    with pytest.raises(ConfigError, match="needs forward costs"):  # a runner with no model
        make_role("sarathi", coupled_tbt_slo_s=0.05)


def test_fastserve_predicts_with_the_recorded_profile(tmp_path):
    _, role = role_from_flags(tmp_path, "--policy", "fastserve")
    assert role.scheduler.profiler.q1 == 0.011  # the profiled decode step, not 0.02
    assert role.scheduler.profiler.source == str(tmp_path / "profile.json")
    assert role.scheduler.costs.forward_s(101) == pytest.approx(0.020)
    _, role = role_from_flags(tmp_path, "--policy", "sarathi")
    assert role.scheduler.costs is None  # sarathi without an SLO predicts nothing
