"""Training drivers: one predictor per granularity, of either kind, from a length dataset.

    train(dataset, OUT, kind, G...) -> OUT (one G) or OUT/g<G> (several), each a predictor
                                       directory, plus OUT/.../eval/{results.json,confusion.png}
                                       and OUT/table.md when evaluating

The target model is the one that labelled the dataset (its metadata says which). The probe
extracts hidden-state features once (cached next to the dataset) and fits one head per G; the
classifier fine-tunes one backbone per G.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from common.config import ConfigError, EngineConfig, ModelConfig
from common.model_files import resolve_model
from length_predictor.base import DEFAULT_MAX_INPUT_TOKENS, PredictorMeta, cut_prompt
from length_predictor.buckets import Bucketing
from length_predictor.dataset import LengthDataset, load_dataset
from length_predictor.evaluate import bucket_labels, evaluate, markdown_table


@dataclass(frozen=True)
class TrainOptions:
    kind: str  # classifier | probe
    granularities: tuple[int, ...] = (200,)
    max_output_tokens: int | None = None  # bucket cap; None = the dataset's generation cap
    max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS  # the cutting limit
    evaluate: bool = True  # score each predictor on the eval split right away
    dtype: str = "auto"  # the target model's dtype (probe features), as served
    cache_dir: str = "~/.cache/splitserve"

    def __post_init__(self) -> None:
        if self.kind not in ("classifier", "probe"):
            raise ConfigError(f"kind must be classifier or probe, got {self.kind!r}")
        if not self.granularities:
            raise ConfigError("give at least one granularity")
        if self.max_input_tokens < 1:
            raise ConfigError("max input tokens must be >= 1")


def bucket_cap(dataset: LengthDataset, requested: int | None) -> int:
    if requested is None:
        return dataset.max_output_tokens
    if dataset.metadata.get("labels") == "engine" and requested > dataset.max_output_tokens:
        raise ConfigError(f"the dataset's generations stopped at {dataset.max_output_tokens} "
                          f"tokens: cannot bucket up to {requested}")
    return requested


def predictor_dirs(out_dir: Path, granularities: tuple[int, ...]) -> dict[int, Path]:
    if len(granularities) == 1:
        return {granularities[0]: out_dir}
    return {g: out_dir / f"g{g}" for g in granularities}


def base_meta(dataset: LengthDataset, options: TrainOptions, kind: str) -> PredictorMeta:
    cap = bucket_cap(dataset, options.max_output_tokens)
    for g in options.granularities:
        Bucketing(g, cap)  # validates every G before any training starts
    return PredictorMeta(kind=kind, granularity=options.granularities[0], max_output_tokens=cap,
                         max_input_tokens=options.max_input_tokens,
                         target_model=dataset.metadata.get("model", ""),
                         target_model_path=dataset.metadata.get("model_path"),
                         labels=dataset.metadata.get("labels", ""),
                         num_train_examples=len(dataset.train), dataset=str(dataset.directory))


def target_config(dataset: LengthDataset, options: TrainOptions) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path=dataset.metadata.get("model_path"),
                                          dtype=options.dtype, cache_dir=options.cache_dir))


def _num_layers(config: EngineConfig) -> int:
    """The target's decoder layer count, from its config.json (no weights loaded)."""
    model = config.model
    hf_dir = resolve_model(model.path, model.resolved_cache_dir).hf_dir
    return int(json.loads((hf_dir / "config.json").read_text())["num_hidden_layers"])


def _finish(predictor, directory: Path, dataset: LengthDataset, options: TrainOptions,
            features=None) -> dict:
    predictor.save(directory)
    if not options.evaluate:
        return {"predictor": str(directory), "granularity": predictor.granularity}
    result = evaluate(predictor, dataset, directory / "eval", features)
    print(f"{predictor.kind} G={predictor.granularity}: accuracy {result['accuracy']:.1%}, "
          f"±1 {result['within_one']:.1%}, majority {result['majority_accuracy']:.1%}",
          file=sys.stderr, flush=True)
    return {"predictor": str(directory), **result}


def train_probes(dataset: LengthDataset, out_dir: Path, options: TrainOptions,
                 probe_options) -> list[dict]:
    import torch

    from length_predictor.features import ExtractOptions, FeatureExtractor, cached_features
    from length_predictor.probe import (ProbePredictor, probe_hyperparameters,
                                        resolve_probe_layers, train_ensemble)

    meta = base_meta(dataset, options, "probe")
    config = target_config(dataset, options)
    layers = resolve_probe_layers(probe_options, _num_layers(config))
    extractor = FeatureExtractor.from_config(config, ExtractOptions(options.max_input_tokens,
                                                                    hidden_layers=layers))
    try:
        def features(split: str, examples):
            return cached_features(extractor, dataset.directory, split,
                                   [e.example_id for e in examples],
                                   [e.prompt_token_ids for e in examples])

        train_x = features("train", dataset.train)
        eval_x = features("eval", dataset.eval) if options.evaluate else None
        dtype = extractor.runner.dtype_name
    finally:
        extractor.close()
    results = []
    for g, directory in predictor_dirs(out_dir, options.granularities).items():
        started = time.time()
        bucketing = Bucketing(g, meta.max_output_tokens)
        labels = torch.tensor(bucket_labels(dataset.train, bucketing))
        ensemble, info = train_ensemble(train_x, labels, bucketing.num_buckets, probe_options,
                                        layers)
        hyper = {**probe_hyperparameters(replace(probe_options, layers=layers), dtype), **info}
        g_meta = replace(meta, granularity=g, train_seconds=round(time.time() - started, 1),
                         hyperparameters=hyper, created_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        results.append(_finish(ProbePredictor(g_meta, ensemble), directory, dataset, options,
                               eval_x))
    return results


def train_classifiers(dataset: LengthDataset, out_dir: Path, options: TrainOptions,
                      classifier_options) -> list[dict]:
    import torch

    from length_predictor import classifier as cls

    meta = base_meta(dataset, options, "classifier")
    target_dir = resolve_model(dataset.metadata.get("model_path"),
                               Path(options.cache_dir).expanduser()).hf_dir
    backbone_dir = Path(classifier_options.backbone or target_dir).expanduser()
    bridge = cls.TokenBridge(target_dir, backbone_dir)
    inputs = [cut_prompt(bridge(e.prompt_token_ids), options.max_input_tokens)
              for e in dataset.train]
    results = []
    for g, directory in predictor_dirs(out_dir, options.granularities).items():
        started = time.time()
        bucketing = Bucketing(g, meta.max_output_tokens)
        model = cls.load_backbone(backbone_dir, bucketing.num_buckets,
                                  classifier_options.num_layers)
        num_trainable = cls.freeze_for_training(model, classifier_options.train_layers)
        examples = [{"input_ids": ids, "labels": label}
                    for ids, label in zip(inputs, bucket_labels(dataset.train, bucketing))]
        info = cls.fit(model, examples, classifier_options)
        # Inference runs in bfloat16 on CPU anyway; saving in it halves the checkpoint.
        model = model.to(torch.bfloat16 if classifier_options.bf16 else torch.float32)
        hyper = {**cls.classifier_hyperparameters(classifier_options, backbone_dir,
                                                  num_trainable, bridge), **info}
        g_meta = replace(meta, granularity=g, train_seconds=round(time.time() - started, 1),
                         hyperparameters=hyper, created_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        predictor = cls.ClassifierPredictor(g_meta, model, bridge, (backbone_dir, target_dir),
                                            classifier_options.batch_size)
        results.append(_finish(predictor, directory, dataset, options))
    return results


def train(dataset_dir: Path, out_dir: Path, options: TrainOptions, kind_options) -> list[dict]:
    """Train (and evaluate) one predictor per granularity; returns one summary per predictor."""
    dataset = load_dataset(dataset_dir)
    run = train_probes if options.kind == "probe" else train_classifiers
    results = run(dataset, out_dir, options, kind_options)
    if options.evaluate:
        write_summary(out_dir, results)
    return results


def write_summary(out_dir: Path, results: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "table.md").write_text(markdown_table(results) + "\n")
