"""The probe kind: small heads on the target model's own last-prompt-token hidden states.

Each head standardizes one hidden state (mean/std of the training set) and applies an MLP (or a
linear layer: logistic regression). The probe reads several layers, every third one from the
middle of the model up to its final state, with a few heads per layer (different seeds and
validation slices), and averages their bucket probabilities: the middle layers predict the
length better than the final one, which is shaped for the next token, and the average of many
small heads varies less than any one of them (docs/length_predictor.md has the measurements).
Heads are trained with plain torch on features from `length_predictor.features`; in serving
they read the hidden states of the prefill forward that already ran
(`BatchPlan.hidden_layers`), so a prediction costs a few tiny matmuls and no extra forward.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from common.config import CacheConfig, EngineConfig, ModelConfig
from common.errors import InvalidRequestError
from common.protocol import LengthPrediction
from length_predictor.base import LengthPredictor, LoadOptions, PredictorMeta

WEIGHTS_FILE = "probe.pt"


@dataclass(frozen=True)
class ProbeOptions:
    hidden_size: int = 256  # width of the MLP's hidden layer; 0 = logistic regression
    dropout: float = 0.1
    epochs: int = 60
    batch_size: int = 128
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    # Share of the training split held out to pick the best epoch (never the eval split).
    val_fraction: float = 0.1
    seed: int = 0
    # Hidden states read, numbered like Hugging Face's `hidden_states` (k = after k decoder
    # layers; the layer count = the final state). None: `default_probe_layers`.
    layers: tuple[int, ...] | None = None
    heads_per_layer: int = 5  # seeds 0..n-1 (+ seed): each its own validation slice


def default_probe_layers(num_layers: int) -> tuple[int, ...]:
    """Every third layer from the middle of the model up to its final state (15, 18, ..., 30
    for SmolLM2-135M's 30 layers)."""
    return tuple(range(num_layers, num_layers // 2 - 1, -3))[::-1]


def resolve_probe_layers(options: ProbeOptions, num_layers: int) -> tuple[int, ...]:
    """The options' layers for a target of `num_layers` (None = default, -1 = the final)."""
    if options.heads_per_layer < 1:
        raise InvalidRequestError("a probe needs at least one head per layer")
    if options.layers is None:
        return default_probe_layers(num_layers)
    layers = tuple(num_layers if layer == -1 else layer for layer in options.layers)
    if any(not 0 <= layer <= num_layers for layer in layers):
        raise InvalidRequestError(f"probe layers {options.layers}: the target has hidden states "
                                  f"0..{num_layers}")
    return layers


class ProbeHead(nn.Module):
    def __init__(self, input_size: int, num_buckets: int, hidden_size: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(input_size))
        self.register_buffer("std", torch.ones(input_size))
        if hidden_size:
            self.net = nn.Sequential(nn.Linear(input_size, hidden_size), nn.GELU(),
                                     nn.Dropout(dropout), nn.Linear(hidden_size, num_buckets))
        else:
            self.net = nn.Linear(input_size, num_buckets)

    def fit_normalization(self, features: torch.Tensor) -> None:
        self.mean.copy_(features.mean(0))
        self.std.copy_(features.std(0).clamp_min(1e-6))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # [N, input_size] -> [N, num_buckets] logits
        return self.net((features - self.mean) / self.std)


def _accuracy(head: ProbeHead, features: torch.Tensor, labels: torch.Tensor) -> float:
    head.eval()
    with torch.no_grad():
        return (head(features).argmax(-1) == labels).float().mean().item()


def train_head(features: torch.Tensor, labels: torch.Tensor, num_buckets: int,
               options: ProbeOptions) -> tuple[ProbeHead, dict]:
    """Fit a head with AdamW; keep the epoch that scored best on a held-out slice of train."""
    generator = torch.Generator().manual_seed(options.seed)
    torch.manual_seed(options.seed)
    order = torch.randperm(len(labels), generator=generator)
    num_val = int(len(labels) * options.val_fraction) if len(labels) >= 20 else 0
    val, fit = order[:num_val], order[num_val:]
    head = ProbeHead(features.shape[1], num_buckets, options.hidden_size, options.dropout)
    head.fit_normalization(features[fit])
    optimizer = torch.optim.AdamW(head.parameters(), lr=options.learning_rate,
                                  weight_decay=options.weight_decay)
    best_acc, best_state, best_epoch = -1.0, None, 0
    for epoch in range(options.epochs):
        head.train()
        for step in fit[torch.randperm(len(fit), generator=generator)].split(options.batch_size):
            loss = nn.functional.cross_entropy(head(features[step]), labels[step])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if num_val:
            acc = _accuracy(head, features[val], labels[val])
            if acc > best_acc:
                best_acc, best_state, best_epoch = acc, copy.deepcopy(head.state_dict()), epoch
    if best_state is not None:
        head.load_state_dict(best_state)
    head.eval()
    return head, {"best_epoch": best_epoch, "val_accuracy": best_acc, "num_val": num_val,
                  "train_accuracy": _accuracy(head, features[fit], labels[fit])}


class ProbeEnsemble(nn.Module):
    """Heads on slots of `[N, len(layers), hidden]` features; the output averages their bucket
    probabilities (not logits: heads trained on different layers have different scales)."""

    def __init__(self, layers: tuple[int, ...], heads: list[ProbeHead], slots: list[int]) -> None:
        super().__init__()
        self.layers = tuple(layers)
        self.heads = nn.ModuleList(heads)
        self.slots = list(slots)

    @property
    def hidden_size(self) -> int:
        return self.heads[0].mean.shape[0]

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # [N, len(layers), hidden] -> [N, num_buckets] probabilities
        probs = [head(features[:, slot]).softmax(-1) for head, slot in zip(self.heads, self.slots)]
        return torch.stack(probs).mean(0)


def train_ensemble(features: torch.Tensor, labels: torch.Tensor, num_buckets: int,
                   options: ProbeOptions, layers: tuple[int, ...]) -> tuple[ProbeEnsemble, dict]:
    """`heads_per_layer` heads on each of `layers` (features `[N, len(layers), hidden]`)."""
    heads, slots, val_accuracies = [], [], []
    for slot in range(len(layers)):
        for k in range(options.heads_per_layer):
            head, info = train_head(features[:, slot], labels, num_buckets,
                                    replace(options, seed=options.seed + k))
            heads.append(head)
            slots.append(slot)
            val_accuracies.append(info["val_accuracy"])
    ensemble = ProbeEnsemble(layers, heads, slots).eval()
    with torch.no_grad():
        train_accuracy = (ensemble(features).argmax(-1) == labels).float().mean().item()
    return ensemble, {"num_heads": len(heads), "head_val_accuracy_mean":
                      round(sum(val_accuracies) / len(val_accuracies), 4),
                      "train_accuracy": round(train_accuracy, 4)}


class ProbePredictor(LengthPredictor):
    kind = "probe"
    uses_hidden_states = True

    def __init__(self, meta: PredictorMeta, ensemble: ProbeEnsemble,
                 options: LoadOptions | None = None) -> None:
        super().__init__(meta)
        self.ensemble = ensemble.eval()
        self.options = options or LoadOptions()
        self._extractor = None  # the target model, only for offline predict_tokens

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.ensemble.layers

    @property
    def input_shape(self) -> tuple[int, int]:
        return len(self.ensemble.layers), self.ensemble.hidden_size

    def check_served_model(self, num_layers: int, hidden_size: int) -> None:
        layers, width = self.hidden_layers, self.input_shape[1]
        if width != hidden_size or max(layers) > num_layers:
            raise InvalidRequestError(
                f"the probe reads hidden states {layers} of width {width} (trained for "
                f"{self.meta.target_model}); the served model has {num_layers} layers of width "
                f"{hidden_size}: train a probe for this model")

    def predict_hidden(self, hidden) -> list[LengthPrediction]:
        """`hidden`: `[N, len(layers), hidden_size]`, or a list of `[len(layers), hidden_size]`
        (`[N, hidden_size]` / `[hidden_size]` rows for a probe of one layer)."""
        if isinstance(hidden, (list, tuple)):
            hidden = (torch.stack(list(hidden)) if hidden else
                      torch.empty(0, *self.input_shape))
        if hidden.dim() == 2 and self.input_shape[0] == 1:
            hidden = hidden.unsqueeze(1)
        if tuple(hidden.shape[1:]) != self.input_shape:
            raise InvalidRequestError(
                f"probe expects hidden states of shape {self.input_shape} (layers "
                f"{self.hidden_layers} of {self.meta.target_model}), got {tuple(hidden.shape)}")
        with torch.inference_mode():
            buckets = self.ensemble(hidden.float().cpu()).argmax(-1).tolist()
        return [self.bucketing.prediction(b) for b in buckets]

    def attach_extractor(self, extractor) -> None:
        """Use this `FeatureExtractor` (the target model) for `predict_tokens`."""
        self._extractor = extractor

    def extractor(self):
        if self._extractor is None:
            from length_predictor.features import ExtractOptions, FeatureExtractor

            model = ModelConfig(path=self.meta.target_model_path,
                                dtype=self.meta.hyperparameters.get("dtype", "auto"),
                                device=self.options.device, cache_dir=self.options.cache_dir,
                                num_threads=self.options.num_threads)
            self._extractor = FeatureExtractor.from_config(
                EngineConfig(model=model, cache=CacheConfig()),
                ExtractOptions(max_input_tokens=self.meta.max_input_tokens,
                               hidden_layers=self.hidden_layers))
        return self._extractor

    def predict_buckets(self, prompts: list[list[int]]) -> list[int]:
        # Offline only: runs the target model's prefill, which serving gets for free.
        features = self.extractor().extract(prompts, progress=False)
        return [p.bucket for p in self.predict_hidden(features)]

    def save_weights(self, directory: Path) -> None:
        first = self.ensemble.heads[0].net
        width = first[0].out_features if isinstance(first, nn.Sequential) else 0
        torch.save({"layers": list(self.ensemble.layers), "slots": self.ensemble.slots,
                    "input_size": self.ensemble.hidden_size, "hidden_size": width,
                    "heads": [head.state_dict() for head in self.ensemble.heads]},
                   directory / WEIGHTS_FILE)

    @classmethod
    def load_weights(cls, meta: PredictorMeta, directory: Path,
                     options: LoadOptions) -> ProbePredictor:
        path = directory / WEIGHTS_FILE
        if not path.is_file():
            raise InvalidRequestError(f"probe weights missing: {path}")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if "heads" not in saved:
            raise InvalidRequestError(f"{path} is a single-head probe of an older splitserve; "
                                      "train it again")
        heads = []
        for state in saved["heads"]:
            head = ProbeHead(saved["input_size"], meta.bucketing.num_buckets, saved["hidden_size"])
            head.load_state_dict(state)
            heads.append(head)
        return cls(meta, ProbeEnsemble(tuple(saved["layers"]), heads, saved["slots"]), options)

    def close(self) -> None:
        if self._extractor is not None:
            self._extractor.close()
            self._extractor = None


def probe_hyperparameters(options: ProbeOptions, dtype: str) -> dict:
    return {**asdict(options), "dtype": dtype}
