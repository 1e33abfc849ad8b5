"""Both predictor kinds learn a synthetic, learnable labelling well above chance, and reload."""

from __future__ import annotations

import random

import pytest
import torch

from common.errors import InvalidRequestError
from length_predictor.base import LoadOptions, PredictorMeta, load_predictor
from length_predictor.classifier import (
    ClassifierOptions,
    ClassifierPredictor,
    TokenBridge,
    fit,
    freeze_for_training,
    load_backbone,
)
from length_predictor.probe import (
    ProbeEnsemble,
    ProbeHead,
    ProbeOptions,
    ProbePredictor,
    default_probe_layers,
    resolve_probe_layers,
    train_ensemble,
    train_head,
)

VOCAB = 64
NUM_BUCKETS = 3


def _tiny_backbone(path):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, pad_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(str(path))
    return path


def _synthetic(n: int, seed: int) -> list[tuple[list[int], int]]:
    """Random prompts whose bucket is set by their last token (what a real length cue is not,
    but a classifier reading the last position must pick up)."""
    rng = random.Random(seed)
    data = []
    for _ in range(n):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 24))]
        data.append((prompt, prompt[-1] * NUM_BUCKETS // VOCAB))
    return data


def _meta(kind: str) -> PredictorMeta:
    return PredictorMeta(kind=kind, granularity=100, max_output_tokens=200, target_model="tiny")


def test_tiny_classifier_learns_above_chance_and_reloads(tmp_path):
    backbone = _tiny_backbone(tmp_path / "backbone")
    options = ClassifierOptions(backbone=str(backbone), num_layers=0, train_layers=-1,
                                max_steps=60, batch_size=16, learning_rate=5e-3, bf16=False)
    model = load_backbone(backbone, NUM_BUCKETS, options.num_layers)
    assert model.config.pad_token_id == 0  # the eos-valued pad would hide real last tokens
    train = _synthetic(512, seed=0)
    info = fit(model, [{"input_ids": p, "labels": y} for p, y in train], options)
    assert info["loss_log"][-1] < info["loss_log"][0]
    predictor = ClassifierPredictor(_meta("classifier"), model, TokenBridge(None, backbone),
                                    (backbone, None))
    held_out = _synthetic(200, seed=1)
    predicted = predictor.predict_buckets([p for p, _ in held_out])
    accuracy = sum(p == y for p, (_, y) in zip(predicted, held_out)) / len(held_out)
    assert accuracy > 0.7, accuracy  # chance is about 1/3
    predictor.save(tmp_path / "saved")
    loaded = load_predictor(tmp_path / "saved", LoadOptions(dtype="float32"))
    assert isinstance(loaded, ClassifierPredictor)
    assert loaded.predict_buckets([p for p, _ in held_out]) == predicted


def test_freezing_trains_only_the_top_layers_norm_and_head(tmp_path):
    backbone = _tiny_backbone(tmp_path / "backbone")
    model = load_backbone(backbone, NUM_BUCKETS, num_layers=0)
    num = freeze_for_training(model, train_layers=1)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(n.startswith("model.layers.1.") for n in trainable)
    assert not any(n.startswith("model.layers.0.") for n in trainable)
    assert {"model.norm.weight", "score.weight"} <= trainable
    assert "model.embed_tokens.weight" not in trainable
    assert num == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_backbone_cut_to_fewer_layers(tmp_path):
    backbone = _tiny_backbone(tmp_path / "backbone")
    assert len(load_backbone(backbone, NUM_BUCKETS, num_layers=1).model.layers) == 1


def _clusters(n: int, seed: int, dim: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(NUM_BUCKETS, dim, generator=torch.Generator().manual_seed(99)) * 2
    labels = torch.randint(0, NUM_BUCKETS, (n,), generator=generator)
    return centers[labels] + torch.randn(n, dim, generator=generator) * 1.5 + 5.0, labels


def _two_layers(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 2, 24]: the same clusters seen through two noisy "layers"."""
    features, labels = _clusters(n, seed)
    noise = torch.randn(features.shape, generator=torch.Generator().manual_seed(seed + 50))
    return torch.stack([features, features + noise], dim=1), labels


@pytest.mark.parametrize("hidden_size", [32, 0])  # MLP and logistic regression
def test_probe_head_learns_above_chance(hidden_size):
    features, labels = _clusters(600, seed=0)
    head, info = train_head(features, labels, NUM_BUCKETS,
                            ProbeOptions(hidden_size=hidden_size, epochs=30))
    assert info["num_val"] == 60 and 0 <= info["best_epoch"] < 30
    test_x, test_y = _clusters(300, seed=1)
    with torch.no_grad():
        accuracy = (head(test_x).argmax(-1) == test_y).float().mean().item()
    assert accuracy > 0.8, accuracy


def test_probe_ensemble_learns_above_chance_and_reloads(tmp_path):
    features, labels = _two_layers(600, seed=0)
    ensemble, info = train_ensemble(features, labels, NUM_BUCKETS,
                                    ProbeOptions(hidden_size=16, epochs=20, heads_per_layer=2),
                                    layers=(1, 2))
    assert info["num_heads"] == 4 and ensemble.slots == [0, 0, 1, 1]
    predictor = ProbePredictor(_meta("probe"), ensemble)
    assert predictor.hidden_layers == (1, 2)
    test_x, test_y = _two_layers(300, seed=1)
    predicted = [p.bucket for p in predictor.predict_hidden(test_x)]
    accuracy = (torch.tensor(predicted) == test_y).float().mean().item()
    assert accuracy > 0.8, accuracy
    predictor.save(tmp_path / "probe")
    loaded = load_predictor(tmp_path / "probe")
    assert loaded.hidden_layers == (1, 2)
    assert [p.bucket for p in loaded.predict_hidden(list(test_x))] == predicted


def _constant_head(size: int, logits: list[float]) -> ProbeHead:
    head = ProbeHead(size, len(logits), 0)
    with torch.no_grad():
        head.net.weight.zero_()
        head.net.bias.copy_(torch.tensor(logits))
    return head


def test_ensemble_averages_probabilities_not_votes():
    # Two heads mildly prefer bucket 0, one is sure of bucket 2: the mean probability picks 2,
    # a majority vote would pick 0.
    heads = [_constant_head(4, [0.3, 0.0, 0.0]), _constant_head(4, [0.3, 0.0, 0.0]),
             _constant_head(4, [0.0, 0.0, 9.0])]
    ensemble = ProbeEnsemble((3, 6), heads, [0, 0, 1])
    probs = ensemble(torch.zeros(1, 2, 4))
    torch.testing.assert_close(probs.sum(-1), torch.ones(1))
    assert probs.argmax(-1).item() == 2


def test_probe_refuses_hidden_states_of_another_shape():
    predictor = ProbePredictor(_meta("probe"), ProbeEnsemble((2,), [ProbeHead(8, 3, 0)], [0]))
    with pytest.raises(InvalidRequestError, match=r"shape \(1, 8\)"):
        predictor.predict_hidden(torch.zeros(2, 9))
    two = ProbePredictor(_meta("probe"), ProbeEnsemble((1, 2), [ProbeHead(8, 3, 0)] * 2, [0, 1]))
    with pytest.raises(InvalidRequestError, match=r"layers \(1, 2\)"):
        two.predict_hidden(torch.zeros(2, 8))  # one layer's states for a two-layer probe


def test_probe_predictions_carry_token_bounds():
    probe = ProbePredictor(_meta("probe"), ProbeEnsemble((2,), [_constant_head(4, [0, 0, 5.0])],
                                                         [0]))
    (prediction,) = probe.predict_hidden(torch.zeros(1, 4))
    assert (prediction.bucket, prediction.lower, prediction.upper) == (2, 200, 200)


def test_probe_layers_default_and_resolution():
    assert default_probe_layers(30) == (15, 18, 21, 24, 27, 30)
    assert default_probe_layers(2) == (2,)
    assert resolve_probe_layers(ProbeOptions(), 30) == (15, 18, 21, 24, 27, 30)
    assert resolve_probe_layers(ProbeOptions(layers=(-1,)), 30) == (30,)
    assert resolve_probe_layers(ProbeOptions(layers=(0, 12)), 30) == (0, 12)
    with pytest.raises(InvalidRequestError, match="hidden states 0..30"):
        resolve_probe_layers(ProbeOptions(layers=(31,)), 30)
    with pytest.raises(InvalidRequestError, match="at least one head"):
        resolve_probe_layers(ProbeOptions(heads_per_layer=0), 30)


def test_loading_something_else_is_a_one_line_error(tmp_path):
    with pytest.raises(InvalidRequestError, match="not a length predictor"):
        load_predictor(tmp_path)
    (tmp_path / "predictor.json").write_text('{"kind": "oracle", "granularity": 1, '
                                             '"max_output_tokens": 2}')
    with pytest.raises(InvalidRequestError, match="unknown predictor kind 'oracle'"):
        load_predictor(tmp_path)
