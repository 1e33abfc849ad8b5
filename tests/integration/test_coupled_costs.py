"""Where a co-located instance's forward costs come from, on a tiny real model: the record of
`splitserve profile` when it fits the model, else a short measurement at start-up."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from common.config import CacheConfig, EngineConfig, ModelConfig
from common.engine.model_runner import ModelRunner
from coupled_instance.role import load_costs


@pytest.fixture(scope="module")
def runner(tiny_models, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    config = EngineConfig(model=ModelConfig(path=str(tiny_models["llama"]), dtype="float32",
                                            cache_dir=str(cache)),
                          cache=CacheConfig(num_blocks=64, block_size=16))
    r = ModelRunner(config)
    yield r
    r.close()


def test_without_a_record_the_costs_are_measured_at_start_up(runner):
    costs = load_costs(SimpleNamespace(runner=runner, config=SimpleNamespace(
        engine=runner.config)))
    assert costs.source == "measured at start-up"
    # prompts up to the context (512 tokens) and the pool (64 x 16); decode batches while
    # 33-token contexts (3 blocks each) fit the 64 blocks
    assert [n for n, _ in costs.prefill] == [1, 16, 64, 256]
    assert [b for b, _ in costs.decode] == [1, 8]
    assert all(seconds > 0 for _, seconds in costs.prefill + costs.decode)


def test_a_record_for_this_model_is_used_and_one_for_another_is_not(runner):
    record = {"model": runner.resolved.name, "dtype": "float32",
              "threads": torch.get_num_threads(),
              "prefill": [{"tokens": 1, "seconds": 0.5}, {"tokens": 64, "seconds": 0.75}],
              "decode": [{"batch": 1, "step_seconds": 0.5}]}
    path = runner.config.model.resolved_cache_dir / "profile.json"
    ctx = SimpleNamespace(runner=runner, config=SimpleNamespace(engine=runner.config))
    path.write_text(json.dumps(record))
    assert load_costs(ctx).forward_s(64) == 0.75
    for other in ({"dtype": "bfloat16"}, {"threads": record["threads"] + 1}):
        path.write_text(json.dumps({**record, **other}))
        assert load_costs(ctx).source == "measured at start-up"
