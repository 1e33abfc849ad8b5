"""Evaluation: bucket accuracy on the held-out split, the majority baseline, confusion matrices.

Metrics of one predictor on one dataset's eval split:
- `accuracy`: exact bucket (TetriInfer's "acc-200" at G = 200);
- `within_one`: predicted bucket at most one away from the true one;
- `majority_*`: the same for always predicting the most common bucket of the *train* split
  (the baseline any predictor must beat; it never looks at the eval labels).
Results go to `OUT/results.json` and `OUT/confusion.png` (rows: true bucket, columns: predicted).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from common.errors import InvalidRequestError
from length_predictor.base import LengthPredictor, PredictorMeta
from length_predictor.buckets import Bucketing
from length_predictor.dataset import LengthDataset


def bucket_labels(dataset_examples, bucketing: Bucketing) -> list[int]:
    return [bucketing.bucket(e.num_output_tokens) for e in dataset_examples]


def majority_bucket(labels: list[int]) -> int:
    return Counter(labels).most_common(1)[0][0]


def bucket_metrics(predicted: list[int], actual: list[int], num_buckets: int,
                   majority: int) -> dict:
    if not actual or len(predicted) != len(actual):
        raise ValueError("need one prediction per label, and at least one label")
    confusion = [[0] * num_buckets for _ in range(num_buckets)]
    for p, a in zip(predicted, actual):
        confusion[a][p] += 1
    n = len(actual)
    return {
        "num_eval": n,
        "accuracy": sum(p == a for p, a in zip(predicted, actual)) / n,
        "within_one": sum(abs(p - a) <= 1 for p, a in zip(predicted, actual)) / n,
        "majority_bucket": majority,
        "majority_accuracy": sum(a == majority for a in actual) / n,
        "majority_within_one": sum(abs(a - majority) <= 1 for a in actual) / n,
        "label_distribution": [sum(row) / n for row in confusion],
        "confusion": confusion,
    }


def check_compatible(meta: PredictorMeta, dataset: LengthDataset) -> None:
    """One-line errors for a dataset whose labels cannot score this predictor."""
    data_model = dataset.metadata.get("model")
    if meta.target_model and data_model and meta.target_model != data_model:
        raise InvalidRequestError(f"predictor learned lengths of {meta.target_model}, but the "
                                  f"dataset's labels come from {data_model}")
    if dataset.metadata.get("labels") == "engine" and meta.max_output_tokens > \
            dataset.max_output_tokens:
        raise InvalidRequestError(
            f"predictor caps lengths at {meta.max_output_tokens} tokens but the dataset's "
            f"generations stopped at {dataset.max_output_tokens}")


def confusion_png(metrics: dict, bucketing: Bucketing, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    confusion = metrics["confusion"]
    k = bucketing.num_buckets
    names = [f"{p.lower}-{p.upper}" for p in map(bucketing.prediction, range(k))]
    fig, ax = plt.subplots(figsize=(1.2 + 0.75 * k, 1.0 + 0.7 * k))
    image = ax.imshow(confusion, cmap="Blues")
    peak = max(max(row) for row in confusion) or 1
    for a in range(k):
        for p in range(k):
            color = "white" if confusion[a][p] > peak / 2 else "black"
            ax.text(p, a, str(confusion[a][p]), ha="center", va="center", color=color, fontsize=8)
    ax.set_xticks(range(k), names, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(k), names, fontsize=8)
    ax.set_xlabel("predicted bucket (tokens)")
    ax.set_ylabel("true bucket (tokens)")
    ax.set_title(f"{title}\nacc {metrics['accuracy']:.1%}, majority "
                 f"{metrics['majority_accuracy']:.1%}", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def evaluate(predictor: LengthPredictor, dataset: LengthDataset, out_dir: Path,
             features=None) -> dict:
    """Score `predictor` on `dataset.eval`; `features` are the eval hidden states for probes."""
    check_compatible(predictor.meta, dataset)
    bucketing = predictor.bucketing
    actual = bucket_labels(dataset.eval, bucketing)
    majority = majority_bucket(bucket_labels(dataset.train, bucketing))
    started = time.perf_counter()
    if features is not None:
        predictions = predictor.predict_hidden(features)
    else:
        predictions = predictor.predict_tokens([e.prompt_token_ids for e in dataset.eval])
    seconds = time.perf_counter() - started
    metrics = bucket_metrics([p.bucket for p in predictions], actual, bucketing.num_buckets,
                             majority)
    meta = predictor.meta
    result = {"kind": meta.kind, "granularity": meta.granularity,
              "max_output_tokens": meta.max_output_tokens, "labels": meta.labels,
              "num_train_examples": meta.num_train_examples, "target_model": meta.target_model,
              "dataset": str(dataset.directory), "predict_seconds": round(seconds, 2),
              "train_seconds": meta.train_seconds, **metrics}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    confusion_png(metrics, bucketing, f"{meta.kind}, G={meta.granularity}, {meta.labels} labels",
                  out_dir / "confusion.png")
    return result


def markdown_table(results: list[dict]) -> str:
    """One row per evaluated predictor: the table docs/length_predictor.md quotes."""
    lines = ["| kind | labels | train ex. | G | buckets | accuracy | ±1 bucket | majority | "
             "majority ±1 | eval ex. |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["kind"], r["labels"], r["granularity"])):
        lines.append(f"| {r['kind']} | {r['labels']} | {r['num_train_examples']} | "
                     f"{r['granularity']} | {len(r['confusion'])} | {r['accuracy']:.1%} | "
                     f"{r['within_one']:.1%} | {r['majority_accuracy']:.1%} | "
                     f"{r['majority_within_one']:.1%} | {r['num_eval']} |")
    return "\n".join(lines)


def predictor_directories(paths: list[Path]) -> list[Path]:
    """Each path is a predictor directory, or holds predictor directories (train's OUT/g<G>)."""
    from length_predictor.base import PREDICTOR_FILE

    found = []
    for path in paths:
        if (path / PREDICTOR_FILE).is_file():
            found.append(path)
            continue
        children = sorted(p for p in path.glob("*") if (p / PREDICTOR_FILE).is_file()) \
            if path.is_dir() else []
        if not children:
            raise InvalidRequestError(f"no length predictor in {path} (no {PREDICTOR_FILE})")
        found += children
    return found


def evaluate_dirs(paths: list[Path], dataset_dir: Path, out_dir: Path | None,
                  cache_dir: str) -> list[dict]:
    """`splitserve predictor eval`: score saved predictors on a dataset's eval split."""
    from length_predictor.base import LoadOptions, load_predictor
    from length_predictor.dataset import load_dataset

    dataset = load_dataset(dataset_dir)
    directories = predictor_directories(paths)
    results = []
    for directory in directories:
        predictor = load_predictor(directory, LoadOptions(cache_dir=cache_dir))
        try:
            check_compatible(predictor.meta, dataset)
            features = _probe_features(predictor, dataset) if predictor.uses_hidden_states \
                else None
            if out_dir is None:
                target = directory / f"eval-{dataset.directory.name}"
            else:
                target = out_dir / directory.name if len(directories) > 1 else out_dir
            results.append({"predictor": str(directory),
                            **evaluate(predictor, dataset, target, features)})
        finally:
            predictor.close()
    return results


def _probe_features(predictor, dataset: LengthDataset):
    from length_predictor.features import cached_features

    return cached_features(predictor.extractor(), dataset.directory, "eval",
                           [e.example_id for e in dataset.eval],
                           [e.prompt_token_ids for e in dataset.eval])
