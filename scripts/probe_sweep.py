"""Sweep the probe head's hyperparameters on a dataset's cached features.

Each configuration is chosen by its accuracy on the held-out slice of the *train* split (what
`train_head` keeps for picking the epoch); the eval split is scored for every configuration but
never used to choose. Needs the features that `splitserve predictor train --kind probe` cached in
DATASET/features/.

    python scripts/probe_sweep.py --dataset results/length_predictor/data-engine-2500 \\
        --granularity 200 [--threads 2] [--with-prompt-length] [--defaults-only]

--with-prompt-length appends log(1 + prompt tokens) to the hidden state, a feature the serving
probe does not have yet: to see whether it would pay for the interface change.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from length_predictor.buckets import Bucketing
from length_predictor.dataset import load_dataset
from length_predictor.probe import ProbeOptions, train_head

GRID = {"hidden_size": (0, 64, 256, 1024), "dropout": (0.1, 0.5), "weight_decay": (0.01, 0.1),
        "learning_rate": (1e-3, 3e-4), "epochs": (60, 150)}


def _split(dataset, features_dir: Path, split: str, bucketing: Bucketing, with_length: bool):
    # The engine's cache (not probe_layers.py's `layers-*`); a multi-layer cache gives its last
    # layer, which is the final state for the default layer sets.
    paths = [p for p in features_dir.glob(f"*-{split}.pt") if not p.name.startswith("layers-")]
    if len(paths) != 1:
        raise SystemExit(f"expected one engine feature cache for {split} in {features_dir}, "
                         f"found {[p.name for p in paths]}")
    saved = torch.load(paths[0], weights_only=True)
    examples = {e.example_id: e for e in (dataset.train if split == "train" else dataset.eval)}
    ids = saved["example_ids"].tolist()
    labels = [bucketing.bucket(examples[i].num_output_tokens) for i in ids]
    features = saved["features"].float()
    if features.dim() == 3:
        features = features[:, -1]
    if with_length:
        lengths = torch.tensor([[float(examples[i].num_prompt_tokens)] for i in ids])
        features = torch.cat([features, torch.log1p(lengths)], dim=1)
    return features, torch.tensor(labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--granularity", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--with-prompt-length", action="store_true")
    parser.add_argument("--defaults-only", action="store_true",
                        help="train the default head only (no sweep)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dataset = load_dataset(args.dataset)
    bucketing = Bucketing(args.granularity, dataset.max_output_tokens)
    features_dir = Path(args.dataset) / "features"
    x_train, y_train = _split(dataset, features_dir, "train", bucketing, args.with_prompt_length)
    x_eval, y_eval = _split(dataset, features_dir, "eval", bucketing, args.with_prompt_length)
    rows = []
    configs = ([{}] if args.defaults_only else
               [dict(zip(GRID, values)) for values in itertools.product(*GRID.values())])
    for config in configs:
        head, info = train_head(x_train, y_train, bucketing.num_buckets, ProbeOptions(**config))
        with torch.no_grad():
            accuracy = (head(x_eval).argmax(-1) == y_eval).float().mean().item()
        rows.append((info["val_accuracy"], accuracy, config))
        print(f"{config}: val {info['val_accuracy']:.3f} eval {accuracy:.3f}", flush=True)
    best_val = max(r[0] for r in rows)
    chosen = [r for r in rows if r[0] == best_val]
    print(f"best validation accuracy {best_val:.3f} ({len(chosen)} configurations); their eval "
          f"accuracy {min(r[1] for r in chosen):.3f}-{max(r[1] for r in chosen):.3f}")


if __name__ == "__main__":
    main()
