"""--no-cuda-graphs and --cuda-graph-max-batch: parsed into ModelConfig, handed by `up` to every
instance, and refused when out of range."""

from __future__ import annotations

import pytest

from common.config import ConfigError, InstanceConfig, ModelConfig
from common.config_json import config_from_json, config_to_json
from control_plane.cli import build_parser
from control_plane.cli_args import cluster_instance_config, engine_config


def handed_over(argv: list[str]) -> ModelConfig:
    """The model config an instance of `splitserve up ARGV` receives."""
    shared = cluster_instance_config(build_parser().parse_args(["up", *argv]))
    return config_from_json(config_to_json(shared), InstanceConfig).engine.model


def test_graphs_are_on_by_default():
    model = engine_config(build_parser().parse_args(["up"])).model
    assert model.cuda_graphs and model.cuda_graph_max_batch == 256
    received = handed_over([])
    assert (received.cuda_graphs, received.cuda_graph_max_batch) == (True, 256)


def test_flags_reach_the_config_and_the_instances():
    args = build_parser().parse_args(["up", "--no-cuda-graphs", "--cuda-graph-max-batch", "32"])
    model = engine_config(args).model
    assert not model.cuda_graphs and model.cuda_graph_max_batch == 32
    received = handed_over(["--no-cuda-graphs", "--cuda-graph-max-batch", "32"])
    assert (received.cuda_graphs, received.cuda_graph_max_batch) == (False, 32)


def test_a_batch_below_one_is_refused():
    with pytest.raises(ConfigError, match="cuda_graph_max_batch"):
        ModelConfig(cuda_graph_max_batch=0)
