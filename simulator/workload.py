"""What arrives when: the simulated requests, from `splitserve bench`'s workloads or synthetic.

A `SimRequest` is what the gateway would receive, reduced to what a simulation needs: when it
arrives, its prompt length, its true output length (the instance samples EOS right there) and
its `max_tokens`. Token ids are made up at arrival (`prompt_ids`): the first one is unique per
request, so no two prompts share a cached prefix (prefix caching finds nothing to reuse, as
with single-turn ShareGPT prompts).

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

    def prompt_ids(self, index: int) -> list[int]:
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


def from_bench(requests: Sequence, offsets: Sequence[float]) -> list[SimRequest]:
    """`splitserve bench`'s requests (bench.workload.BenchRequest or its subclass
    bench.workloads.WorkloadRequest) and their arrival offsets."""
    if len(requests) != len(offsets):
        raise ConfigError("one arrival offset per request is needed")
    return [SimRequest(f"r{i}", float(t), r.num_prompt_tokens, r.max_tokens, r.max_tokens,
                       getattr(r, "workload_class", ""))
            for i, (r, t) in enumerate(zip(requests, offsets))]
