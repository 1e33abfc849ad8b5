"""Benchmark workloads: which requests to send (ShareGPT prompts) and when (arrival times).

Requests carry token counts measured with the served model's tokenizer, so prompt-length bounds
and output caps mean the same thing to the client as to the server. Arrival times are offsets in
seconds from the start of the run, reproducible from a seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from common.config import ConfigError
from common.sharegpt import first_turns, load_sharegpt


class Tokenizer(Protocol):
    """What the workload needs of `common.tokenizer.TextTokenizer`."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: its prompt, its length in tokens and its output budget."""

    prompt: str
    num_prompt_tokens: int
    max_tokens: int
    # Length of the dataset's reply, in tokens: what a real user would have received.
    reference_output_tokens: int


def sample_sharegpt_requests(tokenizer: Tokenizer, num_requests: int, max_tokens: int, seed: int,
                             max_prompt_tokens: int = 1024, min_prompt_tokens: int = 4,
                             use_reference_lengths: bool = True,
                             pairs: Sequence[tuple[str, str]] | None = None
                             ) -> list[BenchRequest]:
    """`num_requests` first-turn ShareGPT prompts with [min, max] prompt tokens, in seeded order.

    With `use_reference_lengths` each request's output budget is its reference reply's length
    capped at `max_tokens` (the usual ShareGPT replay); otherwise every request gets `max_tokens`.
    `pairs` replaces the dataset's (prompt, reply) pairs, for tests and other corpora. Raises
    ConfigError (a ValueError) when fewer than `num_requests` prompts fit the bounds.
    """
    if num_requests < 1 or max_tokens < 1 or not 1 <= min_prompt_tokens <= max_prompt_tokens:
        raise ConfigError("need num_requests >= 1, max_tokens >= 1 and "
                         "1 <= min_prompt_tokens <= max_prompt_tokens")
    candidates = list(first_turns(load_sharegpt()) if pairs is None else pairs)
    random.Random(seed).shuffle(candidates)
    requests: list[BenchRequest] = []
    # Tokenizing all ~11 K pairs takes about 15 s; stop as soon as we have enough.
    for prompt, reply in candidates:
        num_prompt_tokens = len(tokenizer.encode(prompt))
        if not min_prompt_tokens <= num_prompt_tokens <= max_prompt_tokens:
            continue
        # The server never generates the special tokens encode() would add around the reply.
        reference = len(tokenizer.encode(reply, add_special_tokens=False))
        budget = min(max_tokens, max(1, reference)) if use_reference_lengths else max_tokens
        requests.append(BenchRequest(prompt, num_prompt_tokens, budget, reference))
        if len(requests) == num_requests:
            return requests
    raise ConfigError(f"only {len(requests)} of {len(candidates)} prompts have "
                     f"{min_prompt_tokens} to {max_prompt_tokens} tokens; "
                     f"{num_requests} were asked for")


def _offsets(gaps: np.ndarray) -> list[float]:
    # The first request goes out at once so the measured duration is not padded by an idle wait.
    return [0.0] + np.cumsum(gaps[1:]).tolist() if len(gaps) else []


def _check(num: int, rate: float) -> None:
    if num < 0:
        raise ConfigError(f"num must be >= 0, got {num}")
    if not rate > 0:
        raise ConfigError(f"rate must be > 0 requests/s (inf = all at once), got {rate}")


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Offsets (s) of a Poisson process with `rate` requests/s; rate=inf sends all at once."""
    _check(num, rate)
    if math.isinf(rate):
        return [0.0] * num
    return _offsets(np.random.default_rng(seed).exponential(1.0 / rate, size=num))


def gamma_arrivals(num: int, rate: float, cv: float, seed: int) -> list[float]:
    """Offsets (s) with gamma inter-arrival gaps of mean 1/rate and coefficient of variation cv.

    cv=1 is a Poisson process; cv>1 is burstier, cv<1 more regular.
    """
    _check(num, rate)
    if not cv > 0:
        raise ConfigError(f"cv must be > 0, got {cv}")
    if math.isinf(rate):
        return [0.0] * num
    shape = 1.0 / (cv * cv)  # a gamma's cv is 1/sqrt(shape)
    scale = 1.0 / (rate * shape)
    return _offsets(np.random.default_rng(seed).gamma(shape, scale, size=num))
