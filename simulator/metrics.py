"""Traces -> the metrics dict `splitserve bench` reports (bench/metrics.py's definitions).

The same keys and the same definitions as `bench.metrics.summarize` and `bench.metrics.goodput`
(tests/unit/simulator/test_metrics.py checks them against those functions): TTFT is the first
token's time minus the arrival, JCT the last token's (or the failure's) minus the arrival, TPOT
(JCT - TTFT) / (output tokens - 1), TBT every gap between consecutive tokens pooled over all
requests, throughput over the first arrival to the last completion, goodput the requests whose
TTFT and whose `tbt_percentile` gap are within the SLOs. Computed with numpy over arrays, not by
building bench's per-request records: an hour at 100 requests/s holds tens of millions of gaps.
Not here: `queueing_delay_s` (None, as `bench` reports without server-side values).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from simulator.cluster import Trace


def stats(values, percentiles: Iterable[int] = (50, 99), mean: bool = True) -> dict:
    """bench.metrics.stats: mean, p50, p99 (numpy's linear percentiles); None when empty."""
    keys = (["mean"] if mean else []) + [f"p{p}" for p in percentiles]
    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        return dict.fromkeys(keys)
    result = {"mean": float(array.mean())} if mean else {}
    for p in percentiles:
        result[f"p{p}"] = float(np.percentile(array, p, method="linear"))
    return result


def _per_second(amount: float, duration_s: float) -> float | None:
    return amount / duration_s if duration_s > 0 else None


def run_duration(traces: Sequence[Trace]) -> float:
    """First arrival to last completion (bench.metrics.run_duration)."""
    ended = [t for t in traces if t.finish is not None]
    if not ended:
        return 0.0
    return max(t.finish for t in ended) - min(t.request.arrival_s for t in ended)


def summarize(traces: Sequence[Trace], duration_s: float) -> dict:
    ok = [t for t in traces if t.error is None]
    ttft = [t.token_times[0] - t.request.arrival_s for t in ok if t.token_times]
    jct = [t.finish - t.request.arrival_s for t in ok if t.finish is not None]
    tpot = [(t.finish - t.token_times[0]) / (len(t.token_times) - 1) for t in ok
            if len(t.token_times) >= 2]
    gaps = [np.diff(np.frombuffer(t.token_times)) for t in ok if len(t.token_times) >= 2]
    prompt = sum(t.request.num_prompt_tokens for t in ok)
    output = sum(len(t.token_times) for t in ok)
    return {
        "num_requests": len(traces), "num_ok": len(ok), "num_errors": len(traces) - len(ok),
        "errors": dict(Counter(t.error for t in traces if t.error is not None).most_common(5)),
        "duration_s": duration_s,
        "ttft_s": stats(ttft), "tpot_s": stats(tpot), "jct_s": stats(jct),
        "tbt_s": stats(np.concatenate(gaps) if gaps else [], mean=False),
        "queueing_delay_s": None,
        "throughput": {"requests_per_s": _per_second(len(ok), duration_s),
                       "output_tokens_per_s": _per_second(output, duration_s),
                       "total_tokens_per_s": _per_second(prompt + output, duration_s)},
        "total_prompt_tokens": prompt, "total_output_tokens": output,
    }


def meets_slo(trace: Trace, ttft_slo_s: float, tbt_slo_s: float, tbt_percentile: float,
              ttft_per_prompt_token_s: float = 0.0) -> bool:
    """bench.metrics.meets_slo; the TTFT bound grows by `ttft_per_prompt_token_s` per prompt
    token (0: bench's fixed bound)."""
    times = trace.token_times
    bound = ttft_slo_s + ttft_per_prompt_token_s * trace.request.num_prompt_tokens
    if trace.error is not None or not times or times[0] - trace.request.arrival_s > bound:
        return False
    if len(times) < 2:
        return True
    gaps = np.diff(np.frombuffer(times))
    # a percentile never exceeds the largest gap: most requests are decided without one
    return float(gaps.max()) <= tbt_slo_s or \
        float(np.percentile(gaps, tbt_percentile)) <= tbt_slo_s


def goodput(traces: Sequence[Trace], duration_s: float, ttft_slo_s: float, tbt_slo_s: float,
            tbt_percentile: float = 99.0, ttft_per_prompt_token_s: float = 0.0) -> dict:
    """bench.metrics.goodput (with meets_slo's prompt-scaled TTFT bound)."""
    met = [t for t in traces
           if meets_slo(t, ttft_slo_s, tbt_slo_s, tbt_percentile, ttft_per_prompt_token_s)]
    return {"ttft_slo_s": ttft_slo_s, "ttft_per_prompt_token_s": ttft_per_prompt_token_s,
            "tbt_slo_s": tbt_slo_s, "tbt_percentile": tbt_percentile,
            "num_met": len(met), "fraction": len(met) / len(traces) if traces else None,
            "requests_per_s": _per_second(len(met), duration_s),
            "output_tokens_per_s": _per_second(sum(len(t.token_times) for t in met),
                                               duration_s)}
