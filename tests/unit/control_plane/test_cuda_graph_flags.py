"""--no-cuda-graphs and --cuda-graph-max-batch: parsed into ModelConfig, forwarded by `up` to
every instance, and refused when out of range."""

from __future__ import annotations

import pytest

from common.config import ConfigError, ModelConfig
from control_plane.cli import build_parser
from control_plane.cli_args import engine_config, instance_passthrough


def test_graphs_are_on_by_default_and_not_forwarded():
    args = build_parser().parse_args(["up"])
    model = engine_config(args).model
    assert model.cuda_graphs and model.cuda_graph_max_batch == 256
    forwarded = instance_passthrough(args)
    assert "--no-cuda-graphs" not in forwarded
    assert forwarded[forwarded.index("--cuda-graph-max-batch") + 1] == "256"


def test_flags_reach_the_config_and_the_instances():
    args = build_parser().parse_args(["up", "--no-cuda-graphs", "--cuda-graph-max-batch", "32"])
    model = engine_config(args).model
    assert not model.cuda_graphs and model.cuda_graph_max_batch == 32
    forwarded = instance_passthrough(args)
    assert "--no-cuda-graphs" in forwarded
    assert forwarded[forwarded.index("--cuda-graph-max-batch") + 1] == "32"
    instance = build_parser().parse_args(["instance", "--role", "decode", *forwarded])
    received = engine_config(instance).model
    assert (received.cuda_graphs, received.cuda_graph_max_batch) == (False, 32)


def test_a_batch_below_one_is_refused():
    with pytest.raises(ConfigError, match="cuda_graph_max_batch"):
        ModelConfig(cuda_graph_max_batch=0)
