"""The interface every predictor kind implements, its saved metadata, and loading by kind.

A predictor maps prompts (target-model token ids) to a length bucket (`length_predictor.buckets`).
Kinds are found by name in `common.plugins.PREDICTORS` (entry points `splitserve.predictors`);
`load_predictor(dir)` reads `predictor.json` and lets the kind load the rest of the directory. No
torch here: kinds import it themselves, when their name is first asked for.

    DIR/predictor.json    PredictorMeta: kind, granularity, cap, cutting limit, target, provenance
    DIR/...               the kind's own files (a transformers checkpoint, a probe state dict)
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from common.errors import InvalidRequestError
from common.plugins import PREDICTORS
from common.protocol import LengthPrediction
from length_predictor.buckets import Bucketing

PREDICTOR_FILE = "predictor.json"
DEFAULT_MAX_INPUT_TOKENS = 512  # TetriInfer's cutting limit for the predictor's inputs


@dataclass(frozen=True)
class PredictorMeta:
    """What a saved predictor is: enough to load it and to say what it was trained on."""

    kind: str
    granularity: int
    max_output_tokens: int  # lengths were capped here before bucketing
    max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS  # inputs are cut to this many tokens
    target_model: str = ""  # name of the model whose output lengths were learned
    target_model_path: str | None = None  # as the user gave it; None = the default model
    labels: str = ""  # engine | reference
    num_train_examples: int = 0
    dataset: str = ""
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    train_seconds: float = 0.0
    created_at: str = ""

    @property
    def bucketing(self) -> Bucketing:
        return Bucketing(self.granularity, self.max_output_tokens)

    @classmethod
    def from_dict(cls, data: dict) -> PredictorMeta:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class LoadOptions:
    """How to load a predictor for inference."""

    device: str = "cpu"
    dtype: str = "auto"  # classifier weights: auto = bfloat16 on CPU, float16 on CUDA
    cache_dir: str = "~/.cache/splitserve"  # the probe's target model (offline use only)
    num_threads: int | None = None


def cut_prompt(token_ids: list[int], limit: int) -> list[int]:
    """At most `limit` tokens: the head and the tail of a longer prompt.

    NOTE: the head holds the system prompt and the start of the request, the tail the end of
    the request and the assistant header the answer starts from; both carry length cues.
    """
    if len(token_ids) <= limit:
        return list(token_ids)
    num_head = limit // 2
    return list(token_ids[:num_head]) + list(token_ids[len(token_ids) - (limit - num_head):])


class LengthPredictor(ABC):
    """Predicts the output-length bucket of prompts, given as target-model token ids.

    Implementations set `kind` and are registered under it (an entry point). A kind that reads
    the target model's own prefill hidden states sets `uses_hidden_states` and implements
    `predict_hidden`, so serving can predict from the main model's forward at no extra cost.
    """

    kind: ClassVar[str]
    uses_hidden_states: ClassVar[bool] = False

    def __init__(self, meta: PredictorMeta) -> None:
        self.meta = meta
        self.bucketing = meta.bucketing

    @property
    def granularity(self) -> int:
        return self.bucketing.granularity

    @property
    def num_buckets(self) -> int:
        return self.bucketing.num_buckets

    def predict_tokens(self, prompts: list[list[int]]) -> list[LengthPrediction]:
        """One prediction per prompt (any length: inputs are cut to `meta.max_input_tokens`)."""
        return [self.bucketing.prediction(b) for b in self.predict_buckets(prompts)]

    @abstractmethod
    def predict_buckets(self, prompts: list[list[int]]) -> list[int]:
        """The most likely bucket of each prompt."""

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Which of the target's hidden states `predict_hidden` reads (`BatchPlan.hidden_layers`;
        empty = the final one)."""
        return ()

    def check_served_model(self, num_layers: int, hidden_size: int) -> None:
        """Raise `InvalidRequestError` if this predictor cannot read the served model's hidden
        states (kinds that read tokens read any model's)."""

    def predict_hidden(self, hidden) -> list[LengthPrediction]:
        """Predictions from the target model's last-prompt-token hidden states: `[N, hidden]`,
        or `[N, len(hidden_layers), hidden]` for a kind that reads several layers."""
        raise InvalidRequestError(f"a {self.kind} predictor does not read hidden states")

    def save(self, directory: Path | str) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.save_weights(directory)
        (directory / PREDICTOR_FILE).write_text(json.dumps(asdict(self.meta), indent=2) + "\n")

    def close(self) -> None:
        """Release what the predictor holds beyond its weights (a loaded target model)."""

    @abstractmethod
    def save_weights(self, directory: Path) -> None:
        """Write the kind's own files next to predictor.json."""

    @classmethod
    @abstractmethod
    def load_weights(cls, meta: PredictorMeta, directory: Path,
                     options: LoadOptions) -> LengthPredictor:
        """Rebuild a saved predictor."""


def read_meta(directory: Path | str) -> PredictorMeta:
    path = Path(directory) / PREDICTOR_FILE
    if not path.is_file():
        raise InvalidRequestError(f"not a length predictor: {path} not found "
                                  f"(train one with `splitserve predictor train`)")
    try:
        return PredictorMeta.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise InvalidRequestError(f"corrupt {path}: {exc}") from None


def predictor_class(kind: str) -> type[LengthPredictor]:
    if kind not in PREDICTORS:
        raise InvalidRequestError(f"unknown predictor kind {kind!r}; known: "
                                  f"{', '.join(PREDICTORS.names())}")
    return PREDICTORS.get(kind)


def load_predictor(directory: Path | str, options: LoadOptions = LoadOptions()) -> LengthPredictor:
    """Load a saved predictor of any kind from its directory."""
    meta = read_meta(directory)
    return predictor_class(meta.kind).load_weights(meta, Path(directory), options)
