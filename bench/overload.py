"""Overload experiment: a burst of --factor x capacity against a cluster with admission limits.

    splitserve up --port 8000 --max-in-flight 16 --max-prefill-queue-tokens 8192 &
    python -m bench.overload --url http://127.0.0.1:8000 --capacity C --factor 10 \
        --seconds 60 --out results/overload

Owns: three open-loop phases of streamed ShareGPT completions (Poisson arrivals): `before` at a
normal load (--normal-fraction x capacity) to measure normal latency, `burst` at
factor x capacity for --seconds, `after` at the normal load again; the per-request record (phase,
status 200/429/other, time to the answer, TTFT of admitted requests); and the checks:
1. excess requests were refused with 429 (with Retry-After);
2. refusals were prompt: p99 time to the 429 answer <= --max-429-s;
3. nothing crashed: no 5xx, no transport error, no error event, every instance still the same
   live process, /health 200;
4. admitted requests kept a bounded TTFT in the burst: p99 <= --ttft-bound-s;
5. latency returned to normal: `after` p50 TTFT <= --recovery-factor x `before` p50 +
   --recovery-slack-s, and no 429 in the second half of `after`;
6. no KV block held once the load drained, no integrity violation.
Writes overload.json and overload.png to --out; exits 1 if a check fails. Helpers come from
bench.soak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from bench.metrics import stats
from bench.soak import (
    StreamResult,
    auth_headers,
    cluster_view,
    integrity_violations,
    load_requests,
    payload_for,
    stream_completion,
    wait_drained,
)
from bench.workload import poisson_arrivals

PHASES = ("before", "burst", "after")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Overload: a burst of factor x capacity")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--capacity", type=float, required=True, help="measured capacity, req/s")
    p.add_argument("--factor", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=60.0, help="length of the burst")
    p.add_argument("--normal-fraction", type=float, default=0.5,
                   help="load before and after the burst, as a fraction of capacity")
    p.add_argument("--before-seconds", type=float, default=30.0)
    p.add_argument("--after-seconds", type=float, default=60.0)
    p.add_argument("--out", default="results/overload")
    p.add_argument("--workload", choices=["sharegpt", "mixed"], default="mixed",
                   help="as bench.soak (use the workload the capacity was measured with)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--cache-dir", default="~/.cache/splitserve")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--pool", type=int, default=400)
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--max-429-s", type=float, default=0.5)
    p.add_argument("--ttft-bound-s", type=float, default=10.0)
    p.add_argument("--recovery-factor", type=float, default=2.0)
    p.add_argument("--recovery-slack-s", type=float, default=0.25)
    p.add_argument("--drain-timeout", type=float, default=180.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def plan(args) -> list[tuple[str, float]]:
    """(phase, arrival offset) for every request, phases back to back."""
    normal = args.normal_fraction * args.capacity
    spans = [("before", normal, args.before_seconds), ("burst", args.factor * args.capacity,
                                                       args.seconds),
             ("after", normal, args.after_seconds)]
    planned, start = [], 0.0
    for index, (phase, rate, seconds) in enumerate(spans):
        count = int(rate * seconds * 1.5) + 10
        offsets = poisson_arrivals(count, rate, args.seed + index)
        planned += [(phase, start + a) for a in offsets if a < seconds]
        start += seconds
    return planned


async def run(args, model: str, pool, planned) -> list[StreamResult]:
    headers = auth_headers(args.api_key)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits,
                                 trust_env=False) as client:
        start = time.monotonic()

        async def fire(index: int, phase: str, arrival: float) -> StreamResult:
            await asyncio.sleep(max(0.0, arrival - (time.monotonic() - start)))
            request = pool[index % len(pool)]
            result = StreamResult(index, time.monotonic() - start, phase, request.max_tokens)
            return await stream_completion(client, args.url, payload_for(model, request),
                                           result, headers)

        return list(await asyncio.gather(*(fire(i, phase, a)
                                           for i, (phase, a) in enumerate(planned))))


def outcome(r: StreamResult) -> str:
    if r.status == 200:
        return "200" if r.error is None else "200+error"
    if r.status in (429, 503):
        return str(r.status)
    return "other"


def phase_summary(results: list[StreamResult], phase: str) -> dict:
    mine = [r for r in results if r.phase == phase]
    counts: dict[str, int] = {}
    for r in mine:
        counts[outcome(r)] = counts.get(outcome(r), 0) + 1
    refused = [r for r in mine if r.status == 429]
    admitted = [r for r in mine if r.status == 200 and r.error is None]
    return {"requests": len(mine), "outcomes": counts,
            "time_to_429_s": stats([r.answer_s for r in refused], (50, 99, 100)),
            "retry_after_values": sorted({r.retry_after for r in refused} - {None}),
            "admitted_ttft_s": stats([r.ttft_s for r in admitted if r.ttft_s is not None]),
            "admitted_jct_s": stats([r.jct_s for r in admitted if r.jct_s is not None])}


def _late_after_429s(results: list[StreamResult], after_start: float, after_s: float) -> int:
    return sum(r.status == 429 for r in results
               if r.phase == "after" and r.send_offset >= after_start + after_s / 2)


def build_checks(args, results, summary, pids_before, pids_after, held, violations,
                 healthy) -> dict:
    burst, before, after = summary["burst"], summary["before"], summary["after"]
    bad = [r for r in results if outcome(r) in ("other", "200+error")]
    t429, ttft = burst["time_to_429_s"], burst["admitted_ttft_s"]
    normal, later = before["admitted_ttft_s"]["p50"], after["admitted_ttft_s"]["p50"]
    bound = None if normal is None else args.recovery_factor * normal + args.recovery_slack_s
    late = _late_after_429s(results, args.before_seconds + args.seconds, args.after_seconds)
    return {
        "excess_refused_with_429": {"ok": burst["outcomes"].get("429", 0) > 0
                                    and bool(burst["retry_after_values"]),
                                    "refused": burst["outcomes"].get("429", 0)},
        "refusals_prompt": {"ok": t429["p99"] is not None and t429["p99"] <= args.max_429_s,
                            "p99_s": t429["p99"], "max_s": t429["p100"]},
        "nothing_crashed": {"ok": not bad and pids_before == pids_after and healthy,
                            "bad_requests": len(bad), "examples": [r.error for r in bad[:5]],
                            "instances_same_and_alive": pids_before == pids_after},
        "admitted_ttft_bounded": {"ok": ttft["p99"] is not None
                                  and ttft["p99"] <= args.ttft_bound_s, "p99_s": ttft["p99"]},
        "latency_back_to_normal": {"ok": bound is not None and later is not None
                                   and later <= bound and late == 0,
                                   "before_p50_s": normal, "after_p50_s": later,
                                   "bound_s": bound, "late_429s": late},
        "no_kv_blocks_held": {"ok": not held and not any(violations.values()), "held": held,
                              "integrity_violations": violations}}


def _live_pids(view: dict) -> dict[str, int]:
    return {i["instance_id"]: i["pid"] for i in view["instances"]
            if Path(f"/proc/{i['pid']}").exists()}


COLORS = {"200": "tab:green", "429": "tab:orange", "503": "tab:purple",
          "200+error": "tab:red", "other": "black"}


def _plot_outcomes(ax, results: list[StreamResult], num_seconds: int) -> None:
    """Stacked bars: requests sent in each second, by outcome."""
    seconds = range(num_seconds)
    base = [0] * num_seconds
    for name, color in COLORS.items():
        counts = [0] * num_seconds
        for r in results:
            if outcome(r) == name and int(r.send_offset) < num_seconds:
                counts[int(r.send_offset)] += 1
        if any(counts):
            ax.bar(seconds, counts, bottom=base, width=1.0, color=color, label=name)
            base = [b + c for b, c in zip(base, counts)]
    ax.set_ylabel("requests sent per second")
    ax.legend(loc="upper right", fontsize=8)


def _plot_latencies(ax, results: list[StreamResult]) -> None:
    ok = [r for r in results if r.status == 200 and r.ttft_s is not None]
    refused = [r for r in results if r.status == 429 and r.answer_s is not None]
    ax.scatter([r.send_offset for r in ok], [r.ttft_s for r in ok], s=6, color="tab:blue",
               label="TTFT of admitted")
    ax.scatter([r.send_offset for r in refused], [r.answer_s for r in refused], s=6,
               marker="x", color="tab:orange", label="time to the 429 answer")
    ax.set_yscale("log")
    ax.set_ylabel("seconds")
    ax.set_xlabel("seconds since start")
    ax.legend(loc="upper right", fontsize=8)


def plot(results: list[StreamResult], args, path: Path) -> None:
    """Outcomes per second (top) and latencies (bottom) over the run; the burst shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    end = args.before_seconds + args.seconds + args.after_seconds
    _plot_outcomes(top, results, int(end) + 1)
    _plot_latencies(bottom, results)
    for ax in (top, bottom):
        ax.axvspan(args.before_seconds, args.before_seconds + args.seconds, color="0.92",
                   zorder=0)
        ax.grid(alpha=0.3)
    top.set_title(f"Burst of {args.factor:g} x {args.capacity:g} req/s for {args.seconds:g} s "
                  f"(shaded), normal load {args.normal_fraction:g} x capacity around it")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pool, planned = load_requests(args), plan(args)
    model = httpx.get(args.url.rstrip("/") + "/v1/models", headers=auth_headers(args.api_key),
                      timeout=10, trust_env=False).json()["data"][0]["id"]
    pids_before = _live_pids(cluster_view(args.url, args.api_key))
    print(f"overload: {len(planned)} requests; burst of {args.factor:g} x {args.capacity:g} "
          f"req/s for {args.seconds:g} s", flush=True)
    results = asyncio.run(run(args, model, pool, planned))
    held, _ = wait_drained(args.url, args.drain_timeout, args.api_key)
    view = cluster_view(args.url, args.api_key)
    healthy = httpx.get(args.url.rstrip("/") + "/health", timeout=10,
                        trust_env=False).status_code == 200
    summary = {phase: phase_summary(results, phase) for phase in PHASES}
    checks = build_checks(args, results, summary, pids_before, _live_pids(view), held,
                          integrity_violations(view), healthy)
    report = {"options": vars(args), "summary": summary, "checks": checks,
              "ok": all(c["ok"] for c in checks.values()),
              "requests": [asdict(r) for r in results]}
    (out / "overload.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    plot(results, args, out / "overload.png")
    _print(report, out)
    return 0 if report["ok"] else 1


def _print(report: dict, out: Path) -> None:
    for phase, s in report["summary"].items():
        ttft, t429 = s["admitted_ttft_s"], s["time_to_429_s"]
        print(f"{phase:>6}: {s['requests']} requests {s['outcomes']}; admitted TTFT p50 "
              f"{_f(ttft['p50'])} p99 {_f(ttft['p99'])} s; time to 429 p50 {_f(t429['p50'])} "
              f"p99 {_f(t429['p99'])} s")
    for name, check in report["checks"].items():
        print(f"  {'PASS' if check['ok'] else 'FAIL'} {name}")
    print(f"wrote {out / 'overload.json'} and {out / 'overload.png'}")


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
