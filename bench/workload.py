"""Benchmark workloads: which requests to send (ShareGPT prompts) and when (arrival times).

Prompts come only from the `bench` range of the project's ShareGPT split (`common.sharegpt`):
the length predictor never trained or was scored on them, and a seed only orders the range.
Requests carry token counts measured with the served model's tokenizer, so prompt-length bounds
and output caps mean the same thing to the client as to the server. Arrival times are offsets in
seconds from the start of the run, reproducible from a seed.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from common.config import ConfigError
from common.sharegpt import load_split

_SPEAKERS = {"human": "User", "gpt": "Assistant"}


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


def bench_first_turns() -> list[tuple[str, str]]:
    """(prompt, reply) of the first turns in the split's bench range, in file order."""
    return [(prompt, reply) for _, prompt, reply in load_split()["bench"].first_turns]


def history_pairs(conversations: Sequence[list], seed: int) -> Iterator[tuple[str, str]]:
    """(earlier turns + human turn as text, the gpt reply) for every later round, conversations
    in seeded order."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    for index in order:
        turns = [t for t in conversations[index] if isinstance(t, dict)]
        lines: list[str] = []
        for position, turn in enumerate(turns[:-1]):
            text, speaker = turn.get("value"), _SPEAKERS.get(turn.get("from"))
            if not isinstance(text, str) or speaker is None:
                break
            lines.append(f"{speaker}: {text}")
            reply = turns[position + 1]
            if (position > 0 and turn.get("from") == "human" and reply.get("from") == "gpt"
                    and isinstance(reply.get("value"), str) and reply["value"].strip()):
                yield "\n\n".join(lines), reply["value"]


def _candidates(pairs: Sequence[tuple[str, str]] | None, seed: int,
                with_history: bool) -> Iterator[tuple[str, str]]:
    """The pairs (default: the bench range's first turns) in seeded order, then, with_history,
    the later rounds of the bench range's conversations."""
    firsts = list(bench_first_turns() if pairs is None else pairs)
    random.Random(seed).shuffle(firsts)
    later = (history_pairs(load_split()["bench"].conversations, seed)
             if with_history and pairs is None else ())
    return itertools.chain(firsts, later)


def sample_sharegpt_requests(tokenizer: Tokenizer, num_requests: int, max_tokens: int, seed: int,
                             max_prompt_tokens: int = 1024, min_prompt_tokens: int = 4,
                             use_reference_lengths: bool = True,
                             pairs: Sequence[tuple[str, str]] | None = None,
                             with_history: bool = False) -> list[BenchRequest]:
    """`num_requests` first-turn prompts of the bench range with [min, max] prompt tokens, in
    seeded order.

    With `use_reference_lengths` each request's output budget is its reference reply's length
    capped at `max_tokens` (the usual ShareGPT replay); otherwise every request gets `max_tokens`.
    `with_history`: when the first turns run out, go on with later rounds of the bench range's
    conversations, their history joined into the prompt (`history_pairs`). `pairs` replaces the
    dataset's (prompt, reply) pairs, for tests and other corpora. Raises ConfigError (a
    ValueError) when fewer than `num_requests` prompts fit the bounds.
    """
    if num_requests < 1 or max_tokens < 1 or not 1 <= min_prompt_tokens <= max_prompt_tokens:
        raise ConfigError("need num_requests >= 1, max_tokens >= 1 and "
                         "1 <= min_prompt_tokens <= max_prompt_tokens")
    requests: list[BenchRequest] = []
    looked_at = 0
    # Tokenizing all ~2.6 K pairs takes about 4 s; stop as soon as we have enough.
    for prompt, reply in _candidates(pairs, seed, with_history):
        looked_at += 1
        # A byte-level BPE token covers at least one byte: a shorter text cannot be long enough.
        if len(prompt.encode()) + 4 < min_prompt_tokens:
            continue
        num_prompt_tokens = len(tokenizer.encode(prompt))
        if not min_prompt_tokens <= num_prompt_tokens <= max_prompt_tokens:
            continue
        # The server never generates the special tokens encode() would add around the reply.
        reference = len(tokenizer.encode(reply, add_special_tokens=False))
        budget = min(max_tokens, max(1, reference)) if use_reference_lengths else max_tokens
        requests.append(BenchRequest(prompt, num_prompt_tokens, budget, reference))
        if len(requests) == num_requests:
            return requests
    raise ConfigError(f"only {len(requests)} of {looked_at} prompts have "
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
