"""`splitserve bench prefix-repeat`: one long prompt sent several times, with and without the
prefix cache, through `splitserve up` (issue 20's "the same 2,000-token prompt sent twice").

For each system (default: `splitserve up` as is, and `splitserve up --no-prefix-cache`), one
cluster is started and the same prompt (ShareGPT bench-range text, cut to `--tokens` tokens by
the model's tokenizer and sent as token ids) is sent `--repeats` times, one after another,
greedy, `--max-tokens` output tokens, streamed; TTFT and end-to-end time of each are recorded.
Printed: each send's TTFT and the ratio of every later send to the first, per system, and the
cached system's later sends against the uncached system's (the baseline of the same run).
Raw data: `--out DIR/prefix_repeat.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from bench.cluster import ClusterProcess
from bench.machine import cpu_kind

DEFAULT_SYSTEMS = {"cached": [], "uncached": ["--no-prefix-cache", "--local-prefill", "off"]}


def long_prompt(num_tokens: int) -> list[int]:
    """`num_tokens` token ids of ShareGPT bench-range text (first turns joined)."""
    from common.model_files import resolve_model
    from common.sharegpt import load_split
    from common.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(resolve_model(None, Path("~/.cache/splitserve").expanduser()).hf_dir)
    ids: list[int] = []
    for _, prompt, _ in load_split()["bench"].first_turns:
        ids += tokenizer.encode(prompt)
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise RuntimeError("the bench range holds fewer tokens than asked for")


def timed_send(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start, first = time.perf_counter(), None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data:") and '"text"' in line:
                first = time.perf_counter() - start
    return {"ttft_s": first, "e2e_s": time.perf_counter() - start}


def run_system(name: str, flags: list[str], prompt: list[int], args, out: Path) -> dict:
    cluster = ClusterProcess(flags, out / f"{name}.log")
    try:
        model = cluster.model()
        sends = [timed_send(cluster.url, model, prompt, args.max_tokens)
                 for _ in range(args.repeats)]
        time.sleep(0.5)  # one more load report, for the counters below
        instances = {i["instance_id"]: i.get("prefix_cache") for i in cluster.cluster()
                     ["instances"]}
    finally:
        cluster.stop()
    return {"flags": flags, "sends": sends, "prefix_cache": instances}


def summarize(results: dict) -> list[str]:
    lines = []
    for name, result in results.items():
        ttfts = [s["ttft_s"] for s in result["sends"]]
        later = [t / ttfts[0] for t in ttfts[1:]]
        lines.append(f"{name:>10}: TTFT " + ", ".join(f"{t * 1e3:.0f} ms" for t in ttfts)
                     + f"; later / first: {', '.join(f'{r:.3f}' for r in later)}")
    if {"cached", "uncached"} <= results.keys():
        cached = statistics.median(s["ttft_s"] for s in results["cached"]["sends"][1:])
        uncached = statistics.median(s["ttft_s"] for s in results["uncached"]["sends"][1:])
        lines.append(f"later sends, median TTFT cached / uncached: {cached / uncached:.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench prefix-repeat",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", default="docs/benchmarks/prefix_repeat")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompt = long_prompt(args.tokens)
    results = {name: run_system(name, flags, prompt, args, out)
               for name, flags in DEFAULT_SYSTEMS.items()}
    report = {"tokens": args.tokens, "repeats": args.repeats, "max_tokens": args.max_tokens,
              "machine": cpu_kind(), "results": results,
              "summary": summarize(results)}
    (out / "prefix_repeat.json").write_text(json.dumps(report, indent=2))
    print("\n".join(report["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
