"""Soak experiment: mixed ShareGPT load for many minutes with random client disconnects.

    python -m bench.soak --url http://127.0.0.1:8000 --rate R --minutes 20 \
        --disconnect-fraction 0.1 --out results/soak

Owns: the open-loop soak load (Poisson arrivals at --rate, streamed completions; a
--disconnect-fraction of the streams is closed by the client after a random number of chunks),
RSS sampling of the gateway and every instance (bench.process_memory), and the end-of-run checks:
1. no error other than the deliberate disconnects (HTTP status, error event, cut stream);
2. zero KV blocks held and empty queues on every instance once the load has drained, and no
   request left in flight at the gateway (GET /cluster);
3. zero KV integrity violations (each instance's /metrics);
4. RSS of every process flat after warm-up (fitted slope over the last 80% of samples);
5. every sampled process still alive.
Writes soak.json and soak_rss.png to --out and exits 1 if any check fails.

Also the cluster helpers bench.overload uses: pid discovery, one streamed request, drain and
integrity checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.metrics import stats
from bench.process_memory import RssSampler, plot_rss, rss_trend
from bench.workload import BenchRequest, poisson_arrivals, sample_sharegpt_requests

PROGRESS_EVERY_S = 30.0


# -- cluster helpers (shared with bench.overload) -----------------------------------------------
def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def cluster_view(url: str, api_key: str | None = None) -> dict:
    return httpx.get(url.rstrip("/") + "/cluster", headers=auth_headers(api_key),
                     timeout=10, trust_env=False).json()


def _parent_pid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _is_gateway(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"up" in argv or b"gateway" in argv


def discover_pids(view: dict, extra: dict[str, int]) -> dict[str, int]:
    """Every instance's pid (GET /cluster), the gateway (the parent of the instances when
    `splitserve up` runs them), and `extra` (name -> pid)."""
    pids = {i["instance_id"]: i["pid"] for i in view["instances"] if i.get("pid")}
    parents = {_parent_pid(pid) for pid in pids.values()} - {None}
    if len(parents) == 1 and _is_gateway(next(iter(parents))):
        pids["gateway"] = next(iter(parents))
    pids.update(extra)
    return pids


def held_blocks(view: dict) -> list[dict]:
    """Instances holding KV blocks or sequences, and the gateway if it has requests in flight."""
    held = [{"instance_id": i["instance_id"], "used_blocks": i["kv_blocks"]["used"],
             "queue": i["queue"]} for i in view["instances"]
            if i["kv_blocks"]["used"] or any(i["queue"].get(k) for k in
                                              ("waiting", "running", "transferring"))]
    if view["gateway"].get("requests_in_flight"):
        held.append({"gateway_requests_in_flight": view["gateway"]["requests_in_flight"]})
    return held


def wait_drained(url: str, timeout_s: float, api_key: str | None = None) -> tuple[list, float]:
    """(what is still held after at most timeout_s, seconds waited)."""
    started = time.monotonic()
    held: list = []
    while time.monotonic() - started < timeout_s:
        held = held_blocks(cluster_view(url, api_key))
        if not held:
            break
        time.sleep(0.5)
    return held, time.monotonic() - started


def integrity_violations(view: dict) -> dict[str, float]:
    """splitserve_kv_integrity_violations_total per instance (0 when the series is absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for inst in view["instances"]:
        text = httpx.get(inst["metrics_url"] + "/metrics", timeout=10, trust_env=False).text
        found[inst["instance_id"]] = sum(
            s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "splitserve_kv_integrity_violations_total")
    return found


@dataclass
class StreamResult:
    """One streamed completion as the client saw it. Times are seconds."""

    index: int
    send_offset: float
    phase: str = ""
    max_tokens: int = 0
    status: int | None = None
    answer_s: float | None = None  # send to response headers (the 200/429 answer)
    ttft_s: float | None = None
    jct_s: float | None = None
    chunks: int = 0
    disconnect_after: int | None = None  # planned client disconnect, in chunks
    disconnected: bool = False  # the client closed the stream on purpose
    error: str | None = None
    retry_after: str | None = None


async def _read_stream(response: httpx.Response, result: StreamResult, sent: float) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if "error" in event:
            result.error = "error event: " + str(event["error"].get("message"))[:300]
            return
        choices = event.get("choices") or []
        if choices and choices[0].get("text"):
            result.chunks += 1
            if result.ttft_s is None:
                result.ttft_s = time.monotonic() - sent
        if result.disconnect_after and result.chunks >= result.disconnect_after:
            result.disconnected = True
            return  # leaving the stream context closes the connection
    result.error = "stream ended without [DONE]"


async def stream_completion(client: httpx.AsyncClient, url: str, payload: dict,
                            result: StreamResult, headers: dict) -> StreamResult:
    """POST a streamed completion, filling `result`; never raises."""
    sent = time.monotonic()
    try:
        async with client.stream("POST", url.rstrip("/") + "/v1/completions", json=payload,
                                 headers=headers) as response:
            result.status, result.answer_s = response.status_code, time.monotonic() - sent
            result.retry_after = response.headers.get("retry-after")
            if response.status_code == 200:
                await _read_stream(response, result, sent)
            else:
                body = (await response.aread())[:300]
                result.error = f"HTTP {response.status_code}: {body.decode(errors='replace')}"
    except Exception as exc:  # noqa: BLE001 (one request's failure is data, not a crash)
        result.error = f"{type(exc).__name__}: {exc}"
    result.jct_s = time.monotonic() - sent
    return result


def payload_for(model: str, request: BenchRequest, ignore_eos: bool = True) -> dict:
    return {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens,
            "temperature": 0.0, "stream": True, "ignore_eos": ignore_eos}


def load_requests(args) -> list[BenchRequest]:
    """`args.pool` ShareGPT requests, token counts in the served model's tokenizer: first turns
    with their reference reply lengths (`sharegpt`), or TetriInfer's Mixed workload, an equal
    share of light/heavy prefill x light/heavy decode (`mixed`, bench/workloads.py)."""
    from common.model_files import resolve_model
    from common.tokenizer import TextTokenizer

    resolved = resolve_model(args.tokenizer, Path(args.cache_dir).expanduser(),
                             in_subprocess=True)
    tokenizer = TextTokenizer(resolved.hf_dir)
    if args.workload == "mixed":
        from bench.workloads import ClassThresholds, sample_workload

        limits = ClassThresholds(max_prompt_tokens=args.max_prompt_tokens,
                                 max_output_tokens=args.max_tokens)
        return list(sample_workload(tokenizer, "Mixed", args.pool, args.seed, limits))
    return sample_sharegpt_requests(tokenizer, args.pool, args.max_tokens, args.seed,
                                    max_prompt_tokens=args.max_prompt_tokens)


# -- the soak ----------------------------------------------------------------------------------
@dataclass
class Progress:
    started: float = field(default_factory=time.monotonic)
    sent: int = 0
    done: int = 0
    errors: int = 0
    disconnects: int = 0
    last_print: float = field(default_factory=time.monotonic)

    def note(self, result: StreamResult) -> None:
        self.done += 1
        self.disconnects += result.disconnected
        self.errors += result.error is not None
        now = time.monotonic()
        if now - self.last_print >= PROGRESS_EVERY_S:
            self.last_print = now
            print(f"[{(now - self.started) / 60:5.1f} min] sent {self.sent}, done {self.done}, "
                  f"errors {self.errors}, deliberate disconnects {self.disconnects}", flush=True)


def plan(args, pool: list[BenchRequest]) -> list[tuple[float, BenchRequest, int | None]]:
    """(arrival offset, request, chunks before a deliberate disconnect or None) for the run."""
    duration = args.minutes * 60.0
    count = max(1, int(args.rate * duration * 1.5) + 10)
    arrivals = [a for a in poisson_arrivals(count, args.rate, args.seed) if a < duration]
    rng = random.Random(args.seed)
    planned = []
    for index, arrival in enumerate(arrivals):
        request = pool[index % len(pool)]
        cut = None
        if request.max_tokens > 1 and rng.random() < args.disconnect_fraction:
            cut = rng.randint(1, request.max_tokens - 1)
        planned.append((arrival, request, cut))
    return planned


async def run_soak(args, model: str, planned: list) -> list[StreamResult]:
    progress = Progress()
    headers = auth_headers(args.api_key)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits,
                                 trust_env=False) as client:
        start = time.monotonic()

        async def fire(index: int, arrival: float, request: BenchRequest, cut: int | None):
            await asyncio.sleep(max(0.0, arrival - (time.monotonic() - start)))
            progress.sent += 1
            result = StreamResult(index, time.monotonic() - start, "soak", request.max_tokens,
                                  disconnect_after=cut)
            await stream_completion(client, args.url, payload_for(model, request), result,
                                    headers)
            progress.note(result)
            return result

        return list(await asyncio.gather(*(fire(i, a, r, c)
                                           for i, (a, r, c) in enumerate(planned))))


def _named_pid(text: str) -> tuple[str, int]:
    name, _, pid = text.rpartition("=")
    return (name or f"pid-{pid}"), int(pid)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Soak: mixed ShareGPT load with client disconnects")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--rate", type=float, required=True, help="requests per second (Poisson)")
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--disconnect-fraction", type=float, default=0.1)
    p.add_argument("--out", default="results/soak")
    p.add_argument("--pids", action="append", type=_named_pid, default=[],
                   help="extra processes to sample: NAME=PID or PID (repeatable)")
    p.add_argument("--sample-interval", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--tokenizer", default=None, help="model dir/file for token counts "
                   "(default: the default model)")
    p.add_argument("--cache-dir", default="~/.cache/splitserve")
    p.add_argument("--workload", choices=["sharegpt", "mixed"], default="mixed",
                   help="first turns at their reply lengths, or TetriInfer's Mixed classes")
    p.add_argument("--max-tokens", type=int, default=256, help="output cap per request")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--pool", type=int, default=400, help="distinct prompts, reused in turn")
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--drain-timeout", type=float, default=120.0)
    p.add_argument("--warmup-fraction", type=float, default=0.2)
    p.add_argument("--rss-tolerance-mib", type=float, default=32.0,
                   help="allowed fitted growth after warm-up (or --rss-tolerance-fraction of "
                        "the median RSS, whichever is larger)")
    p.add_argument("--rss-tolerance-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _checks(results, held, violations, trends, disconnect_expected: bool) -> dict:
    errors = [r for r in results if r.error and not r.disconnected]
    checks = {
        "no_errors_but_deliberate_disconnects": {"ok": not errors, "errors": len(errors),
                                                 "examples": [r.error for r in errors[:5]]},
        "no_kv_blocks_held_after_drain": {"ok": not held, "held": held},
        "no_integrity_violations": {"ok": not any(violations.values()), "per_instance": violations},
        "rss_flat_after_warmup": {"ok": all(t["flat"] for t in trends.values()),
                                  "not_flat": [n for n, t in trends.items() if not t["flat"]]},
        "all_processes_alive": {"ok": all(t["alive"] for t in trends.values()),
                                "dead": [n for n, t in trends.items() if not t["alive"]]}}
    if disconnect_expected:
        disconnects = sum(r.disconnected for r in results)
        checks["disconnects_exercised"] = {"ok": disconnects > 0, "disconnects": disconnects}
    return checks


def summarize(results: list[StreamResult], duration_s: float) -> dict:
    completed = [r for r in results if r.error is None and not r.disconnected]
    return {"requests": len(results), "completed": len(completed),
            "deliberate_disconnects": sum(r.disconnected for r in results),
            "errors": sum(r.error is not None and not r.disconnected for r in results),
            "duration_s": duration_s,
            "ttft_s": stats([r.ttft_s for r in completed if r.ttft_s is not None]),
            "jct_s": stats([r.jct_s for r in completed if r.jct_s is not None]),
            "output_tokens_per_s": sum(r.chunks for r in results) / max(duration_s, 1e-9)}


def report(args, summary, checks, sampler, trends, held_wait_s, results) -> dict:
    return {"options": vars(args), "summary": summary, "drain_wait_s": held_wait_s,
            "checks": checks, "ok": all(c["ok"] for c in checks.values()),
            "rss": {**sampler.to_dict(), "trends": trends},
            "requests": [asdict(r) for r in results]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pool = load_requests(args)
    planned = plan(args, pool)
    view = cluster_view(args.url, args.api_key)
    model = httpx.get(args.url.rstrip("/") + "/v1/models", headers=auth_headers(args.api_key),
                      timeout=10, trust_env=False).json()["data"][0]["id"]
    sampler = RssSampler(discover_pids(view, dict(args.pids)), args.sample_interval).start()
    print(f"soak: {len(planned)} requests at {args.rate}/s for {args.minutes} min; sampling "
          f"RSS of {sorted(sampler.pids)}", flush=True)
    started = time.monotonic()
    results = asyncio.run(run_soak(args, model, planned))
    duration = time.monotonic() - started
    held, waited = wait_drained(args.url, args.drain_timeout, args.api_key)
    sampler.stop()
    trends = {name: rss_trend(sampler.times, values, args.warmup_fraction,
                              args.rss_tolerance_mib, args.rss_tolerance_fraction)
              for name, values in sampler.rss.items()}
    checks = _checks(results, held, integrity_violations(cluster_view(args.url, args.api_key)),
                     trends, args.disconnect_fraction > 0 and len(planned) >= 20)
    result = report(args, summarize(results, duration), checks, sampler, trends, waited, results)
    (out / "soak.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    plot_rss(sampler.times, sampler.rss, out / "soak_rss.png",
             f"RSS during a {args.minutes:g}-min soak at {args.rate:g} req/s",
             args.warmup_fraction)
    _print_result(result, out)
    return 0 if result["ok"] else 1


def _print_result(result: dict, out: Path) -> None:
    s = result["summary"]
    ttft = s["ttft_s"]
    print(f"{s['requests']} requests: {s['completed']} completed, {s['deliberate_disconnects']} "
          f"deliberate disconnects, {s['errors']} errors; TTFT p50 "
          f"{_fmt(ttft['p50'])} s, p99 {_fmt(ttft['p99'])} s")
    for name, trend in result["rss"]["trends"].items():
        print(f"  RSS {name:<12} {trend.get('first_mib', math.nan):8.1f} -> "
              f"{trend.get('last_mib', math.nan):8.1f} MiB, slope "
              f"{trend.get('slope_mib_per_min', math.nan):+.3f} MiB/min, flat={trend['flat']}")
    for name, check in result["checks"].items():
        print(f"  {'PASS' if check['ok'] else 'FAIL'} {name}")
    print(f"wrote {out / 'soak.json'} and {out / 'soak_rss.png'}")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
