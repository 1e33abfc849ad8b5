"""The config tree as JSON (how `splitserve up` hands instances their config): a round trip
gives the same frozen objects back, and what no flag could have given is refused."""

from __future__ import annotations

import pytest

from common.config import (
    ConfigError,
    EmulationConfig,
    GatewayConfig,
    InstanceConfig,
    LimitsConfig,
    PredictionConfig,
    TransferConfig,
)
from common.config_json import config_from_json, config_to_json
from common.protocol import LengthPrediction


def test_a_round_trip_gives_equal_configs():
    instance = InstanceConfig(
        role="coupled", gateways=("tcp://a:1", "tcp://b:2"),
        coupled_options=(("num_queues", 4.0),), prediction=PredictionConfig(predictor="oracle"),
        transfer=TransferConfig(emulation=EmulationConfig(bandwidth=1e9, bytes_per_token=8)))
    gateway = GatewayConfig(limits=LimitsConfig(api_keys=("k",)), flip_options=(("ratio", 3.0),))
    for config in (instance, gateway, InstanceConfig()):
        assert config_from_json(config_to_json(config), type(config)) == config


def test_missing_fields_take_their_defaults():
    config = config_from_json('{"role": "decode", "prediction": {"heavy_threshold": 64}}',
                              InstanceConfig)
    assert config.role == "decode" and config.prediction == PredictionConfig(heavy_threshold=64)
    assert config.engine == InstanceConfig().engine


@pytest.mark.parametrize("text, message", [
    ('{"engine": {"cache": {"block_sise": 8}}}', "engine.cache.block_sise"),
    ('{"engine": {"cache": {"block_size": 12}}}', "power of two"),
    ('{"report_interval_s": "fast"}', "Expected `float`"),
    ('{"role": ', "bad InstanceConfig JSON"),
])
def test_what_no_flag_could_give_is_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        config_from_json(text, InstanceConfig)


def test_one_prediction_config_decides_heavy_and_the_planned_length():
    prediction = LengthPrediction(1, 100, 200)
    assert PredictionConfig().predicted_output(prediction) == 100
    assert PredictionConfig(use_upper_end=True).predicted_output(prediction) == 200
    assert not PredictionConfig(heavy_threshold=100).is_heavy(prediction)
    assert PredictionConfig(heavy_threshold=100, use_upper_end=True).is_heavy(prediction)
    assert not PredictionConfig(heavy_threshold=0).is_heavy(None)
