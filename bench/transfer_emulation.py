"""TTFT, time to the second token, and JCT against emulated KV bandwidth, request- vs chunk-level.

For each granularity and each bandwidth (1 Gbps to 300 GB/s by default) this starts a cluster
(`splitserve up` with `--emulate-bandwidth`, the OPT-13B byte count per token, and the
granularity), sends the same prompts one at a time (no queueing: latencies are the pipeline's
own), and records per request: TTFT (the first token comes from the prefill instance, before any
transfer), the time to the second token (the decode instance starts only once the KV has
landed), and JCT. Writes JSON and a PNG.

    python -m bench.transfer_emulation --out results/transfer_emulation
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.cluster import ClusterProcess
from common.config import OPT_13B_BYTES_PER_TOKEN

GBPS = 1e9 / 8  # bytes per second in one gigabit per second
DEFAULT_BANDWIDTHS = (1 * GBPS, 10 * GBPS, 25 * GBPS, 100 * GBPS, 200 * GBPS, 300e9)


@dataclass(frozen=True)
class EmulationOptions:
    bandwidths: tuple[float, ...] = DEFAULT_BANDWIDTHS  # bytes per second
    granularities: tuple[str, ...] = ("request", "chunk")
    num_requests: int = 6
    prompt_words: int = 170  # about 500 tokens with the default tokenizer
    max_tokens: int = 16
    bytes_per_token: int = OPT_13B_BYTES_PER_TOKEN
    chunk_size: int = 128
    extra_args: tuple[str, ...] = ()  # more `splitserve up` flags (e.g. --model)
    out: str = "results/transfer_emulation"
    log_dir: str = "results/transfer_emulation/logs"


async def _timed_stream(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    started = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": chunk["error"]["message"]}
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    arrivals.append(time.perf_counter() - started)
    if len(arrivals) < 2:
        return {"error": "fewer than two tokens"}
    return {"ttft_s": arrivals[0], "second_token_s": arrivals[1], "jct_s": arrivals[-1]}


async def _measure(url: str, options: EmulationOptions) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        words = " ".join(f"w{j}" for j in range(options.prompt_words))
        results = []
        for i in range(options.num_requests + 1):  # the first one warms the cluster up
            body = {"model": model, "prompt": f"Request {i}: {words}", "stream": True,
                    "max_tokens": options.max_tokens, "ignore_eos": True}
            outcome = await _timed_stream(client, url, body)
            if i > 0:
                results.append(outcome)
        return results


def _summary(results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    summary = {"num_ok": len(ok), "num_errors": len(results) - len(ok)}
    for key in ("ttft_s", "second_token_s", "jct_s"):
        summary[key] = statistics.median(r[key] for r in ok) if ok else None
    return summary


def run_point(options: EmulationOptions, granularity: str, bandwidth: float) -> dict:
    log_dir = Path(options.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    args = ["--transfer-granularity", granularity, "--emulate-bandwidth", str(bandwidth),
            "--emulate-bytes-per-token", str(options.bytes_per_token), "--chunk-size",
            str(options.chunk_size), *options.extra_args]
    with ClusterProcess(args, log_dir / f"{granularity}-{bandwidth:.3g}.log") as cluster:
        results = asyncio.run(_measure(cluster.url, options))
    point = {"granularity": granularity, "bandwidth_bytes_per_s": bandwidth,
             "bandwidth_gbps": bandwidth * 8 / 1e9, **_summary(results), "requests": results}
    print(f"{granularity:8s} {bandwidth * 8 / 1e9:8.1f} Gbps: TTFT {point['ttft_s']:.3f} s, "
          f"2nd token {point['second_token_s']:.3f} s, JCT {point['jct_s']:.3f} s", flush=True)
    return point


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharex=True)
    for ax, key, title in zip(axes, ("ttft_s", "second_token_s", "jct_s"),
                              ("TTFT", "time to second token", "JCT")):
        for granularity, style in (("request", "o-"), ("chunk", "s--")):
            rows = [p for p in points if p["granularity"] == granularity and p[key] is not None]
            ax.plot([p["bandwidth_gbps"] for p in rows], [p[key] for p in rows], style,
                    label=f"{granularity}-level")
        ax.set(xscale="log", xlabel="emulated bandwidth (Gbps)", ylabel="seconds (median)",
               title=title)
        ax.legend()
    fig.suptitle("KV transfer emulated at OPT-13B size (819,200 B/token)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_transfer_emulation(options: EmulationOptions) -> dict:
    points = [run_point(options, g, b) for g in options.granularities for b in options.bandwidths]
    report = {"options": asdict(options), "points": points}
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer_emulation.json").write_text(json.dumps(report, indent=1))
    plot(points, out / "transfer_emulation.png")
    print(f"wrote {out}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bandwidths", type=float, nargs="+", default=list(DEFAULT_BANDWIDTHS))
    parser.add_argument("--num-requests", type=int, default=6)
    parser.add_argument("--prompt-words", type=int, default=170)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--out", default="results/transfer_emulation")
    args, up_args = parser.parse_known_args()  # the rest go to `splitserve up`
    run_transfer_emulation(EmulationOptions(
        bandwidths=tuple(args.bandwidths), num_requests=args.num_requests,
        prompt_words=args.prompt_words, max_tokens=args.max_tokens, chunk_size=args.chunk_size,
        extra_args=tuple(a for a in up_args if a != "--"), out=args.out,
        log_dir=f"{args.out}/logs"))


if __name__ == "__main__":
    main()
