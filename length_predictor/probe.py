"""The probe kind: a small head on the target model's own last-prompt-token hidden state.

The head standardizes the feature (mean/std of the training set) and applies an MLP (or a
linear layer: logistic regression). It is trained with plain torch on features from
`length_predictor.features`; in serving it reads `ModelOutput.hidden` of the prefill forward
that already ran, so a prediction costs one tiny matmul and no extra forward.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from common.config import CacheConfig, EngineConfig, ModelConfig
from common.errors import InvalidRequestError
from length_predictor.base import PREDICTORS, LengthPredictor, LoadOptions, PredictorMeta
from length_predictor.buckets import LengthPrediction

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


@PREDICTORS.register("probe")
class ProbePredictor(LengthPredictor):
    kind = "probe"
    uses_hidden_states = True

    def __init__(self, meta: PredictorMeta, head: ProbeHead,
                 options: LoadOptions | None = None) -> None:
        super().__init__(meta)
        self.head = head.eval()
        self.options = options or LoadOptions()
        self._extractor = None  # the target model, only for offline predict_tokens

    @property
    def input_size(self) -> int:
        return self.head.mean.shape[0]

    def predict_hidden(self, hidden) -> list[LengthPrediction]:
        """`hidden`: `[N, hidden_size]` tensor, or a list of `[hidden_size]` tensors."""
        if isinstance(hidden, (list, tuple)):
            hidden = torch.stack(list(hidden)) if hidden else torch.empty(0, self.input_size)
        if hidden.dim() != 2 or hidden.shape[1] != self.input_size:
            raise InvalidRequestError(f"probe expects hidden states of size {self.input_size} "
                                      f"(trained on {self.meta.target_model}), got "
                                      f"{tuple(hidden.shape)}")
        with torch.inference_mode():
            buckets = self.head(hidden.float().cpu()).argmax(-1).tolist()
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
                ExtractOptions(max_input_tokens=self.meta.max_input_tokens))
        return self._extractor

    def predict_buckets(self, prompts: list[list[int]]) -> list[int]:
        # Offline only: runs the target model's prefill, which serving gets for free.
        features = self.extractor().extract(prompts, progress=False)
        return [p.bucket for p in self.predict_hidden(features)]

    def save_weights(self, directory: Path) -> None:
        hidden = self.head.net[0].out_features if isinstance(self.head.net, nn.Sequential) else 0
        torch.save({"state_dict": self.head.state_dict(), "input_size": self.input_size,
                    "hidden_size": hidden}, directory / WEIGHTS_FILE)

    @classmethod
    def load_weights(cls, meta: PredictorMeta, directory: Path,
                     options: LoadOptions) -> ProbePredictor:
        path = directory / WEIGHTS_FILE
        if not path.is_file():
            raise InvalidRequestError(f"probe weights missing: {path}")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        head = ProbeHead(saved["input_size"], meta.bucketing.num_buckets, saved["hidden_size"])
        head.load_state_dict(saved["state_dict"])
        return cls(meta, head, options)

    def close(self) -> None:
        if self._extractor is not None:
            self._extractor.close()
            self._extractor = None


def probe_hyperparameters(options: ProbeOptions, dtype: str) -> dict:
    return {**asdict(options), "dtype": dtype}
