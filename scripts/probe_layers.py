"""Which of the target model's hidden states predict the output length best?

An experiment, not part of serving: runs each dataset prompt (cut like the probe's input)
through the Hugging Face copy of the target model with `output_hidden_states`, keeps for every
layer the last prompt token's state and the mean over the prompt, and caches them in
`DATASET/features/layers-{split}.pt` (float16). Then trains the default probe head on several
choices of layers and pooling; each choice is scored by 5-fold cross-validation on the *train*
split (what a user would choose by) and on the eval split (reported, never used to choose).
With --ensembles it compares instead the rules for the probe's layer set (`ProbeEnsemble`:
the mean probability of `--heads-per-layer` heads on each layer), the same way; this is how
the probe's default (every third layer from the middle up) was chosen.

    python scripts/probe_layers.py --dataset results/length_predictor/data-engine-2900 \\
        --granularity 200 [--threads 2] [--extract-only | --ensembles [--heads-per-layer 3]
        [--rules "every third"]]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from common.model_files import resolve_model
from length_predictor.base import DEFAULT_MAX_INPUT_TOKENS, cut_prompt
from length_predictor.buckets import Bucketing
from length_predictor.dataset import load_dataset
from length_predictor.probe import ProbeOptions, default_probe_layers, train_ensemble, train_head

ENSEMBLE_RULES = {  # for a model of n layers; n itself is the final normed state
    "final": lambda n: (n,),
    "middle": lambda n: (n // 2,),
    "upper half, every layer": lambda n: tuple(range(n // 2, n + 1)),
    "upper half, every third (default)": default_probe_layers,
}


def _extract(model, prompts: list[list[int]], batch_tokens: int = 2048) -> torch.Tensor:
    """[N, layers + 1, 2, hidden] float16: (last token, mean) per hidden state."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = None
    with tqdm(total=len(prompts), file=sys.stderr, desc="layer features") as bar, \
            torch.inference_mode():
        start = 0
        while start < len(order):
            longest = len(prompts[order[start]])
            rows = [order[start]]
            while (start + len(rows) < len(order) and
                   len(prompts[order[start + len(rows)]]) * (len(rows) + 1) <= batch_tokens):
                rows.append(order[start + len(rows)])
            longest = max(len(prompts[i]) for i in rows)
            ids = torch.zeros(len(rows), longest, dtype=torch.long)
            mask = torch.zeros(len(rows), longest, dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, :len(prompts[i])] = torch.tensor(prompts[i])
                mask[r, :len(prompts[i])] = 1
            states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True
                           ).hidden_states
            stacked = torch.stack(states, dim=1).float()  # [B, L+1, T, H]
            if out is None:
                out = torch.empty(len(prompts), stacked.shape[1], 2, stacked.shape[3],
                                  dtype=torch.float16)
            lengths = mask.sum(1)
            last = stacked[torch.arange(len(rows)), :, lengths - 1]
            weights = (mask / lengths[:, None]).float()[:, None, :, None]
            mean = (stacked * weights).sum(2)
            for r, i in enumerate(rows):
                out[i, :, 0] = last[r].half()
                out[i, :, 1] = mean[r].half()
            start += len(rows)
            bar.update(len(rows))
    return out


def layer_features(dataset_dir: Path, split: str, examples, hf_dir: Path) -> torch.Tensor:
    path = dataset_dir / "features" / f"layers-{split}.pt"
    ids = [e.example_id for e in examples]
    if path.exists():
        saved = torch.load(path, weights_only=True)
        if saved["example_ids"].tolist() == ids:
            return saved["features"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    prompts = [cut_prompt(e.prompt_token_ids, DEFAULT_MAX_INPUT_TOKENS) for e in examples]
    features = _extract(model, prompts)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"example_ids": torch.tensor(ids), "features": features}, path)
    return features


def _select(features: torch.Tensor, layers: tuple[int, ...], pooling: str) -> torch.Tensor:
    picks = {"last": [0], "mean": [1], "both": [0, 1]}[pooling]
    return features[:, list(layers)][:, :, picks].flatten(1).float()


def _cross_validated(x: torch.Tensor, y: torch.Tensor, num_buckets: int, folds: int = 5) -> float:
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))
    correct = 0
    for part in order.chunk(folds):
        keep = torch.ones(len(y), dtype=torch.bool)
        keep[part] = False
        head, _ = train_head(x[keep], y[keep], num_buckets, ProbeOptions())
        with torch.no_grad():
            correct += (head(x[part]).argmax(-1) == y[part]).sum().item()
    return correct / len(y)


def _ensemble_scores(x_train, y_train, x_eval, y_eval, num_buckets: int, layers,
                     heads_per_layer: int, folds: int = 5) -> tuple[float, float]:
    """(cross-validated accuracy on train, eval accuracy) of a `ProbeEnsemble` on `layers`."""
    options = ProbeOptions(heads_per_layer=heads_per_layer)
    pick = lambda x: x[:, list(layers), 0].float()  # last-token states
    order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(1))
    correct = 0
    for part in order.chunk(folds):
        keep = torch.ones(len(y_train), dtype=torch.bool)
        keep[part] = False
        ensemble, _ = train_ensemble(pick(x_train)[keep], y_train[keep], num_buckets, options,
                                     tuple(layers))
        with torch.no_grad():
            correct += (ensemble(pick(x_train)[part]).argmax(-1) == y_train[part]).sum().item()
    ensemble, _ = train_ensemble(pick(x_train), y_train, num_buckets, options, tuple(layers))
    with torch.no_grad():
        accuracy = (ensemble(pick(x_eval)).argmax(-1) == y_eval).float().mean().item()
    return correct / len(y_train), accuracy


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--granularity", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--extract-only", action="store_true")
    parser.add_argument("--ensembles", action="store_true",
                        help="compare the layer-set rules of the ensemble probe")
    parser.add_argument("--heads-per-layer", type=int, default=3)
    parser.add_argument("--rules", default="",
                        help="with --ensembles: only the rules whose name contains this")
    parser.add_argument("--choices", default="",
                        help="semicolon-separated 'layers:pooling', e.g. '30:last;15,30:both'")
    return parser.parse_args()


def _single_head_choices(text: str, num_layers: int) -> list[tuple[tuple[int, ...], str]]:
    if text:
        return [(tuple(int(v) for v in c.split(":")[0].split(",")), c.split(":")[1])
                for c in text.split(";")]
    return [((layer,), pooling) for layer in range(0, num_layers + 1, 3)
            for pooling in ("last", "mean")]


def main() -> None:
    args = _parse_args()
    torch.set_num_threads(args.threads)
    dataset_dir = Path(args.dataset)
    dataset = load_dataset(dataset_dir)
    hf_dir = resolve_model(dataset.metadata.get("model_path"),
                           Path("~/.cache/splitserve").expanduser()).hf_dir
    x_train = layer_features(dataset_dir, "train", dataset.train, hf_dir)
    x_eval = layer_features(dataset_dir, "eval", dataset.eval, hf_dir)
    if args.extract_only:
        return
    bucketing = Bucketing(args.granularity, dataset.max_output_tokens)
    y_train = torch.tensor([bucketing.bucket(e.num_output_tokens) for e in dataset.train])
    y_eval = torch.tensor([bucketing.bucket(e.num_output_tokens) for e in dataset.eval])
    num_layers = x_train.shape[1] - 1
    if args.ensembles:
        for name, rule in ENSEMBLE_RULES.items():
            if args.rules not in name:
                continue
            cv, acc = _ensemble_scores(x_train, y_train, x_eval, y_eval, bucketing.num_buckets,
                                       rule(num_layers), args.heads_per_layer)
            print(f"{name} {rule(num_layers)}: cv {cv:.3f} eval {acc:.3f}", flush=True)
        return
    for layers, pooling in _single_head_choices(args.choices, num_layers):
        xt, xe = _select(x_train, layers, pooling), _select(x_eval, layers, pooling)
        cv = _cross_validated(xt, y_train, bucketing.num_buckets)
        head, _ = train_head(xt, y_train, bucketing.num_buckets, ProbeOptions())
        with torch.no_grad():
            acc = (head(xe).argmax(-1) == y_eval).float().mean().item()
        print(f"layers {layers} {pooling}: cv {cv:.3f} eval {acc:.3f}", flush=True)


if __name__ == "__main__":
    main()
