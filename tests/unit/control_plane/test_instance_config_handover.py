"""`splitserve up` hands each instance its whole InstanceConfig as JSON (`instance
--config-json`); an instance started by hand builds the same config from its flags."""

from __future__ import annotations

import pytest

from common.config import ConfigError, InstanceConfig
from common.config_json import config_to_json
from control_plane.cli import build_parser, main, received_instance_config
from control_plane.cli_args import cluster_instance_config
from control_plane.launcher import instance_of

# One non-default value in every section of the instance config.
FLAGS = ["--dtype", "float32", "--max-model-len", "1024", "--block-size", "32",
         "--num-blocks", "64", "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
         "--seed", "3", "--no-cuda-graphs", "--transfer", "shm", "--transfer-timeout", "5",
         "--transfer-granularity", "chunk", "--transfer-failure-policy", "fail",
         "--emulate-bandwidth", "roce-200g", "--emulate-latency", "0.001",
         "--emulate-bytes-per-token", "819200", "--report-interval", "0.2",
         "--prefill-policy", "ljf", "--prefill-sched-batch", "4", "--chunk-size", "64",
         "--pad-chunks", "--lease-timeout", "9", "--dispatch-policy", "imbalance",
         "--heavy-threshold", "50", "--use-upper-end", "--predictor", "oracle",
         "--predictor-mode", "sequential", "--oracle-granularity", "100",
         "--decode-admission", "reserve-dynamic", "--decode-preempt", "swap",
         "--decode-swap-blocks", "16", "--heartbeat-ttl", "3", "--stall-timeout", "30",
         "--policy", "fastserve", "--swap-blocks", "12", "--policy-option", "num_queues=4",
         "--redis", "redis://127.0.0.1:6379/0", "--store-prefix", "t",
         "--cluster-secret-file", "/tmp/secret", "--no-prefix-cache"]


def instance(*argv: str) -> InstanceConfig:
    return received_instance_config(build_parser().parse_args(["instance", *argv]))


def test_up_hands_over_what_the_same_flags_give_an_instance_started_by_hand():
    shared = cluster_instance_config(build_parser().parse_args(["up", *FLAGS]))
    handed = instance_of(shared, "decode", 1, "tcp://127.0.0.1:9000")
    received = instance("--config-json", config_to_json(handed))
    by_hand = instance("--role", "decode", "--instance-id", "decode-1", "--gateway",
                       "tcp://127.0.0.1:9000", "--metrics-port", "-1", *FLAGS)
    assert received == handed == by_hand
    assert received.prediction.heavy_threshold == 50 and received.prediction.use_upper_end
    assert received.transfer.emulation.bandwidth == 200e9 / 8


def test_prefill_threads_reach_only_prefill_instances():
    shared = cluster_instance_config(build_parser().parse_args(["up", "--threads", "1"]))
    assert instance_of(shared, "prefill", 0, "tcp://g:1", 2).engine.model.num_threads == 2
    assert instance_of(shared, "decode", 0, "tcp://g:1").engine.model.num_threads == 1
    assert shared.engine.cache.prefix_caching and not cluster_instance_config(
        build_parser().parse_args(["up", "--no-prefix-cache"])).engine.cache.prefix_caching


def test_an_instance_needs_a_role_or_a_config():
    with pytest.raises(ConfigError, match="--role"):
        instance()


def test_flags_beside_config_json_are_refused_not_ignored():
    with pytest.raises(ConfigError, match="--chunk-size"):
        instance("--config-json", config_to_json(InstanceConfig()), "--chunk-size", "8")


def test_a_bad_config_is_one_line_and_status_2(capsys):
    assert main(["instance", "--config-json", '{"prefill": {"chunk_sise": 8}}']) == 2
    assert "prefill.chunk_sise" in capsys.readouterr().err
    assert main(["instance", "--config-json", '{"prefill": {"policy": "lifo"}}']) == 2
    assert "prefill policy must be one of" in capsys.readouterr().err
