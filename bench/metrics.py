"""Benchmark metrics: per-request records in, latency distributions and throughput out.

Definitions (all in seconds, over successful requests only):
- TTFT: first text chunk minus send time.
- TPOT: (JCT - TTFT) / (output_tokens - 1), per request with at least 2 output tokens.
- JCT: send to end of stream.
- TBT: every gap between consecutive text chunks, pooled over all requests; its tail shows
  decode stalls (e.g. a co-located prefill) that a per-request mean such as TPOT hides.
- Throughput: over `duration_s`, first send to last completion (see `run_duration`).
`errors` counts the most common error messages, so a failed run says why at a glance.
Percentiles use numpy's linear interpolation. Empty inputs give None, never an exception.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import numpy as np

from bench.client import RequestRecord


def stats(values: Sequence[float], percentiles: Iterable[int] = (50, 99),
          mean: bool = True) -> dict[str, float | None]:
    """{"mean", "p50", "p99"} of the values; every entry is None when there are none."""
    keys = (["mean"] if mean else []) + [f"p{p}" for p in percentiles]
    if len(values) == 0:
        return dict.fromkeys(keys)
    array = np.asarray(values, dtype=np.float64)
    result = {"mean": float(array.mean())} if mean else {}
    for p in percentiles:
        result[f"p{p}"] = float(np.percentile(array, p, method="linear"))
    return result


def run_duration(records: Sequence[RequestRecord]) -> float:
    """Seconds from the first send to the last completion (0.0 for no finished request)."""
    finished = [r for r in records if r.jct is not None]
    if not finished:
        return 0.0
    return max(r.send_time + r.jct for r in finished) - min(r.send_time for r in finished)


def _tpot(record: RequestRecord) -> float | None:
    tokens = record.output_tokens
    if tokens is None or tokens < 2 or record.ttft is None or record.jct is None:
        return None
    return (record.jct - record.ttft) / (tokens - 1)


def _per_second(amount: float, duration_s: float) -> float | None:
    return amount / duration_s if duration_s > 0 else None


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict:
    """Counts, latency distributions and throughput of one run; see the module docstring."""
    ok = [r for r in records if r.error is None]
    tpots = [t for t in map(_tpot, ok) if t is not None]
    gaps = [gap for r in ok for gap in np.diff(r.token_times).tolist()]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "errors": dict(Counter(r.error for r in records if r.error is not None).most_common(5)),
        "duration_s": duration_s,
        "ttft_s": stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": stats(tpots),
        "jct_s": stats([r.jct for r in ok if r.jct is not None]),
        "tbt_s": stats(gaps, mean=False),
        "throughput": {
            "requests_per_s": _per_second(len(ok), duration_s),
            "output_tokens_per_s": _per_second(output_tokens, duration_s),
            "total_tokens_per_s": _per_second(prompt_tokens + output_tokens, duration_s),
        },
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
    }
