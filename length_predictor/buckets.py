"""Length buckets: generated lengths -> classes of granularity G, and a class -> token bounds.

Pure Python (no torch). A prediction is a `common.protocol.LengthPrediction` (bucket, lower and
upper token bounds): it travels with the sequence to the dispatcher and the decode instance.

    G = 200, max_output_tokens = 512:
    bucket    0           1            2
    tokens  [0, 200)  [200, 400)  [400, 512]      lengths are capped at 512 first

Bucket i covers [i*G, (i+1)*G); lengths are capped at `max_output_tokens`, so the last bucket
also holds every capped length ("at least `lower`").
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import ConfigError
from common.protocol import LengthPrediction

DEFAULT_GRANULARITIES = (100, 200, 400)


@dataclass(frozen=True)
class Bucketing:
    """The class scheme of one predictor: granularity G and the length cap."""

    granularity: int
    max_output_tokens: int

    def __post_init__(self) -> None:
        if self.granularity <= 0:
            raise ConfigError(f"granularity must be > 0, got {self.granularity}")
        if self.max_output_tokens <= 0:
            raise ConfigError(f"max output tokens must be > 0, got {self.max_output_tokens}")
        if self.granularity > self.max_output_tokens:
            raise ConfigError(f"granularity {self.granularity} is above the length cap "
                              f"{self.max_output_tokens}: every length would be one bucket")

    @property
    def num_buckets(self) -> int:
        return self.max_output_tokens // self.granularity + 1

    def bucket(self, num_tokens: int) -> int:
        return min(max(num_tokens, 0), self.max_output_tokens) // self.granularity

    def prediction(self, bucket: int) -> LengthPrediction:
        if not 0 <= bucket < self.num_buckets:
            raise ValueError(f"bucket {bucket} out of range 0..{self.num_buckets - 1}")
        lower = bucket * self.granularity
        upper = min(lower + self.granularity, self.max_output_tokens)
        return LengthPrediction(bucket, lower, upper)


def parse_granularities(text: str) -> tuple[int, ...]:
    """`"100,200,400"` -> (100, 200, 400); one line of error for anything else."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"granularity must be integers separated by commas, got {text!r}") \
            from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"granularity must be positive integers, got {text!r}")
    if len(set(values)) != len(values):
        raise ConfigError(f"granularity lists a value twice: {text!r}")
    return values
