"""Benchmark metrics: per-request records in, latency distributions and throughput out.

Definitions (all in seconds, over successful requests only):
- TTFT: the first token's chunk minus send time (its text may be empty: a special token; vLLM's
  and SGLang's clients count it so; until 2026-12-02 this was the first non-empty text).
- TPOT: (JCT - TTFT) / (output_tokens - 1), per request with at least 2 output tokens.
- JCT: send to end of stream.
- TBT: every gap between consecutive token chunks, pooled over all requests; its tail shows
  decode stalls (e.g. a co-located prefill) that a per-request mean such as TPOT hides.
- Throughput: over `duration_s`, first send to last completion (see `run_duration`).
- Queueing delay: arrival at the server until its first forward. The client cannot see it; it is
  None unless the caller passes server-side values (`queueing_delays`).
- Goodput: requests meeting both a TTFT and a TBT SLO (see `meets_slo`), as a fraction of all
  requests and per second.
- Instance time (TetriInfer's cost basis): every instance is paid for the whole run's wall time
  from when it is ready to the end, busy or idle (`wall_usage`).
- Resource usage: instance-seconds of forward work during the run, the sum over instances of the
  change in `busy_seconds` that `GET /cluster` reports (`resource_usage`).
- perf/$: output tokens of successful requests per instance-second of instance time, times
  1 / `cost_per_instance_second` (1.0: every instance costs the same); beside it
  `perf_per_busy_dollar`, the same per busy instance-second. docs/coupled.md.
`errors` counts the most common error messages, so a failed run says why at a glance.
Percentiles use numpy's linear interpolation. Empty inputs give None, never an exception.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

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


def summarize(records: Sequence[RequestRecord], duration_s: float,
              queueing_delays: Sequence[float] | None = None) -> dict:
    """Counts, latency distributions and throughput of one run; see the module docstring.
    `queueing_delays`: server-side values, one per request, when the server exposes them."""
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
        "queueing_delay_s": None if queueing_delays is None else stats(queueing_delays),
        "throughput": {
            "requests_per_s": _per_second(len(ok), duration_s),
            "output_tokens_per_s": _per_second(output_tokens, duration_s),
            "total_tokens_per_s": _per_second(prompt_tokens + output_tokens, duration_s),
        },
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
    }


def meets_slo(record: RequestRecord, ttft_slo_s: float, tbt_slo_s: float,
              tbt_percentile: float = 99.0) -> bool:
    """A successful request whose TTFT is within `ttft_slo_s` and whose token gaps are within
    `tbt_slo_s` at `tbt_percentile` (99: all but its slowest 1% of gaps; 100: every gap)."""
    if record.error is not None or record.ttft is None or record.ttft > ttft_slo_s:
        return False
    gaps = np.diff(record.token_times)
    return len(gaps) == 0 or float(np.percentile(gaps, tbt_percentile)) <= tbt_slo_s


def goodput(records: Sequence[RequestRecord], duration_s: float, ttft_slo_s: float,
            tbt_slo_s: float, tbt_percentile: float = 99.0) -> dict:
    """Requests meeting both SLOs: how many, their fraction of all requests (failures count as
    misses), and per second over the run."""
    met = [r for r in records if meets_slo(r, ttft_slo_s, tbt_slo_s, tbt_percentile)]
    return {"ttft_slo_s": ttft_slo_s, "tbt_slo_s": tbt_slo_s, "tbt_percentile": tbt_percentile,
            "num_met": len(met), "fraction": len(met) / len(records) if records else None,
            "requests_per_s": _per_second(len(met), duration_s),
            "output_tokens_per_s": _per_second(sum(r.output_tokens or 0 for r in met),
                                               duration_s)}


def _instances(cluster: dict | list) -> list[dict]:
    return cluster.get("instances", []) if isinstance(cluster, dict) else cluster


def _busy_by_instance(cluster: dict | list) -> dict[str, float]:
    return {row["instance_id"]: float(row.get("busy_seconds", 0.0)) for row in _instances(cluster)}


def wall_usage(before: dict | list, after: dict | list, wall_seconds: float) -> dict:
    """Instance-seconds paid for a run of `wall_seconds` between two `GET /cluster` answers:
    an instance present before pays the whole run; one that came up during the run pays from
    its first report (`uptime_s` in the answer after; the whole run when the answer lacks it);
    one lost during the run pays to the end (it was paid for until replaced; when it died is not
    known here)."""
    start = set(_busy_by_instance(before))
    per_instance = {}
    for row in _instances(after):
        ready_for = wall_seconds if row["instance_id"] in start else \
            float(row.get("uptime_s", wall_seconds))
        per_instance[row["instance_id"]] = min(max(ready_for, 0.0), wall_seconds)
    per_instance.update({i: wall_seconds for i in start - set(per_instance)})
    return {"instance_seconds": sum(per_instance.values()), "per_instance": per_instance,
            "wall_seconds": wall_seconds, "num_instances": len(per_instance)}


def resource_usage(before: dict | list, after: dict | list) -> dict:
    """Instance-seconds of forward work between two `GET /cluster` answers (or their
    "instances" lists). An instance absent before counts from zero; one absent after (it died)
    is left out, so its work in the run is not counted: `num_lost` says how many."""
    start, end = _busy_by_instance(before), _busy_by_instance(after)
    per_instance = {k: max(0.0, v - start.get(k, 0.0)) for k, v in end.items()}
    return {"instance_seconds": sum(per_instance.values()), "per_instance": per_instance,
            "num_instances": len(per_instance), "num_lost": len(set(start) - set(end))}


def perf_per_dollar(output_tokens: int, instance_seconds: float,
                    cost_per_instance_second: float = 1.0) -> float | None:
    """Output tokens per unit of cost; with the default cost, per instance-second used."""
    if instance_seconds <= 0 or cost_per_instance_second <= 0:
        return None
    return output_tokens / (instance_seconds * cost_per_instance_second)


def cost_report(summary: dict, before: dict | list, after: dict | list,
                wall_seconds: float | None = None, cost_per_instance_second: float = 1.0) -> dict:
    """Instance time, resource usage and perf/$ of a run (per instance time: the primary one;
    per busy time beside it), from its summary and the /cluster answers around it.
    `wall_seconds`: the run's wall time; by default its duration, first send to last finish."""
    wall = summary["duration_s"] if wall_seconds is None else wall_seconds
    paid, busy = wall_usage(before, after, wall), resource_usage(before, after)
    tokens = summary["total_output_tokens"]
    return {"wall_usage": paid, "resource_usage": busy,
            "cost_per_instance_second": cost_per_instance_second,
            "perf_per_dollar": perf_per_dollar(tokens, paid["instance_seconds"],
                                               cost_per_instance_second),
            "perf_per_busy_dollar": perf_per_dollar(tokens, busy["instance_seconds"],
                                                    cost_per_instance_second)}
