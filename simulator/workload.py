"""What arrives when: the simulated requests, from `splitserve bench`'s workloads or synthetic.

A `SimRequest` is what the gateway would receive, reduced to what a simulation needs: when it
arrives, its prompt length, its true output length (the instance samples EOS right there) and
its `max_tokens`, and where a tokenizer gave them its prompt's token ids: then prompts share
cached prefixes as the real ones do (bench's TetriInfer classes take heavy prompts from earlier
turns of a conversation, `WorkloadRequest.from_history`, so one prompt often holds another; on
2026-12-02's Zen 5 the real prefill instance found 32-37 of 100 HPLD prompts partly cached).
Else the ids are made up at arrival (`prompt_ids`): the first one unique per request, so no two
prompts share a cached prefix.

Sources:
- `from_bench`: the requests and arrival offsets `splitserve bench` builds (bench.workload's
  ShareGPT replay, bench.workloads' TetriInfer classes LPLD/LPHD/HPLD/HPHD/Mixed); each request
  generates its `max_tokens` (the TetriInfer classes run with ignore-EOS; the ShareGPT replay
  caps each request at its reference reply's length);
- `synthetic`: lengths drawn from log-normal distributions (SYNTHETIC, not ShareGPT: for speed
  benchmarks and tests, no tokenizer or dataset needed), arrivals from bench.workload's Poisson
  or gamma processes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.workload import gamma_arrivals, poisson_arrivals
from common.config import ConfigError

EOS_TOKEN = 2  # what the simulated sampler returns for a request's last token
FILLER_TOKEN = 3  # every other sampled token
FIRST_PROMPT_ID = 1000  # prompt i starts with token FIRST_PROMPT_ID + i


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    output_tokens: int  # the true output length: the sampler returns EOS at this token
    max_tokens: int  # the request's cap (>= output_tokens)
    workload_class: str = ""
    prompt_token_ids: tuple[int, ...] | None = None  # the real prompt's, where known

    def prompt_ids(self, index: int) -> list[int]:
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        return [FIRST_PROMPT_ID + index] + [FILLER_TOKEN] * (self.num_prompt_tokens - 1)


@dataclass(frozen=True)
class SyntheticShape:
    """Log-normal prompt and output lengths (medians and log-space spreads), clipped."""

    prompt_median: float = 256.0
    prompt_sigma: float = 1.0
    output_median: float = 128.0
    output_sigma: float = 1.0
    max_prompt_tokens: int = 2048
    max_output_tokens: int = 512


def arrivals(num: int, rate: float, seed: int, arrival: str = "poisson",
             cv: float = 1.0) -> list[float]:
    """Offsets in seconds, from bench.workload's arrival processes."""
    if arrival == "gamma":
        return gamma_arrivals(num, rate, cv, seed)
    if arrival != "poisson":
        raise ConfigError(f"arrival must be poisson or gamma, got {arrival!r}")
    return poisson_arrivals(num, rate, seed)


def synthetic(num: int, rate: float, seed: int, shape: SyntheticShape = SyntheticShape(),
              arrival: str = "poisson", cv: float = 1.0) -> list[SimRequest]:
    """`num` SYNTHETIC requests (see the module docstring), reproducible from `seed`."""
    rng = np.random.default_rng(seed + 1)  # apart from the arrival process's stream

    def lengths(median: float, sigma: float, cap: int) -> list[int]:
        drawn = rng.lognormal(math.log(median), sigma, size=num)
        return np.clip(np.rint(drawn), 1, cap).astype(int).tolist()

    prompts = lengths(shape.prompt_median, shape.prompt_sigma, shape.max_prompt_tokens)
    outputs = lengths(shape.output_median, shape.output_sigma, shape.max_output_tokens)
    times = arrivals(num, rate, seed, arrival, cv)
    return [SimRequest(f"r{i}", t, p, o, o) for i, (t, p, o) in
            enumerate(zip(times, prompts, outputs))]


def from_bench(requests: Sequence, offsets: Sequence[float],
               tokenizer=None) -> list[SimRequest]:
    """`splitserve bench`'s requests (bench.workload.BenchRequest or its subclass
    bench.workloads.WorkloadRequest) and their arrival offsets; with the `tokenizer` bench
    counted their prompts with, each prompt's token ids (so shared prefixes are cached)."""
    if len(requests) != len(offsets):
        raise ConfigError("one arrival offset per request is needed")
    return [SimRequest(f"r{i}", float(t), r.num_prompt_tokens, r.max_tokens, r.max_tokens,
                       getattr(r, "workload_class", ""), _token_ids(r, tokenizer))
            for i, (r, t) in enumerate(zip(requests, offsets))]


def _token_ids(request, tokenizer) -> tuple[int, ...] | None:
    if tokenizer is None:
        return None
    ids = tuple(tokenizer.encode(request.prompt))
    if len(ids) != request.num_prompt_tokens:
        raise ConfigError(f"the tokenizer gives {len(ids)} prompt tokens where bench counted "
                          f"{request.num_prompt_tokens}: not the tokenizer bench used")
    return ids
