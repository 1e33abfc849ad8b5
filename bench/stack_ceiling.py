"""`splitserve bench stack-ceiling`: does anything but the model cap served throughput?

Owns: the benchmark's options, the served runs (`splitserve up` per layout under a closed-loop
load, each process's CPU measured), and the run that ties them to the engine alone
(bench.stack_engine) and writes the report (bench.stack_report).

The model (bench.stack_engine) is a random-weight Llama of 4 layers (hidden 256, intermediate
768, 4 query / 2 KV heads) with the default model's tokenizer (vocabulary 49,152): cheap enough
that everything around the engine shows: scheduling, messages, the KV hand-off, detokenizing,
SSE and the client.

1. Served: `splitserve up` per layout (1P+1D; co-located sarathi), each instance with
   `--threads` torch threads; per seed and mode (greedy; sampled at temperature 0.7, top_p
   0.95) 128 prompts of 280-340 tokens from the bench range of the ShareGPT split (mean about
   311; the seed picks and orders them: first turns, then, as the range holds only about 50
   first turns that long, later rounds with their history) with 64 output tokens each
   (ignore_eos), 32 streams at a time (a closed loop), through bench.client.
2. Just before each served run, the engine alone (the model runner by itself, same threads):
   a decode step at batch 32 with every sequence at the run's mean context, greedy and sampled.
3. Report: served output tok/s / engine-alone greedy tok/s (1.0 = the stack costs nothing
   beyond the model's decode steps); each process's CPU over the run (/proc/<pid>/stat utime +
   stime) as cores (a share of the run's wall time) and as µs per output token: the client
   (this process), the gateway (the `up` process), each instance, and others (whatever else
   the machine ran; a run disturbed by other load is measured again).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import cpu_share, stack_report
from bench.stack_engine import EngineAlone, EngineSettings

LAYOUTS = {"1P+1D": ["--prefill", "1", "--decode", "1"],
           "co-located": ["--prefill", "0", "--decode", "0", "--coupled", "1",
                          "--policy", "sarathi"]}
MODES = {"greedy": {"temperature": 0.0, "top_p": None},
         "sampled": {"temperature": 0.7, "top_p": 0.95}}


@dataclass(frozen=True)
class StackOptions:
    """One benchmark run; the defaults are issue 18's workload (see the module docstring)."""

    layouts: tuple[str, ...] = tuple(LAYOUTS)
    modes: tuple[str, ...] = tuple(MODES)
    seeds: tuple[int, ...] = (0, 1, 2)
    num_requests: int = 128
    concurrency: int = 32
    max_tokens: int = 64
    min_prompt_tokens: int = 280
    max_prompt_tokens: int = 340
    threads: int = 1  # torch threads of every served instance, and of the engine alone
    chunk_size: int = 512  # prefill ChunkSize and co-located token budget
    repeats: int = 50  # engine-alone timings: median of this many forwards
    # A measurement during which other processes kept more than `max_others` cores busy is
    # taken again (up to `attempts` times in all), after waiting for the machine to be quiet.
    max_others: float = 0.15
    attempts: int = 3
    quiet_timeout_s: float = 300.0
    cache_dir: str = "~/.cache/splitserve"
    out: str = "results/stack_ceiling.json"
    extra_args: tuple[str, ...] = ()  # more `splitserve up` flags, for every layout

    @property
    def decode_context(self) -> int:
        """Tokens in each sequence's cache for the engine-alone step: a served sequence's
        mean context over its decode (mid prompt range plus half the output)."""
        return (self.min_prompt_tokens + self.max_prompt_tokens) // 2 + self.max_tokens // 2


def parse_args(argv: list[str] | None = None) -> StackOptions:
    d = StackOptions()
    parser = argparse.ArgumentParser(prog="splitserve bench stack-ceiling",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default=",".join(d.layouts),
                        help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    parser.add_argument("--modes", default=",".join(d.modes),
                        help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--seeds", type=int, default=len(d.seeds),
                        help="repeats, each with its own workload seed (0, 1, ...)")
    parser.add_argument("--num-requests", type=int, default=d.num_requests)
    parser.add_argument("--concurrency", type=int, default=d.concurrency)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--min-prompt-tokens", type=int, default=d.min_prompt_tokens)
    parser.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    parser.add_argument("--threads", type=int, default=d.threads,
                        help="torch threads per instance (and for the engine alone)")
    parser.add_argument("--chunk-size", type=int, default=d.chunk_size,
                        help="prefill ChunkSize and co-located token budget")
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--max-others", type=float, default=d.max_others,
                        help="cores other processes may use during a measurement; above, it "
                             "is taken again")
    parser.add_argument("--attempts", type=int, default=d.attempts,
                        help="tries per measurement while other load disturbs it")
    parser.add_argument("--cache-dir", default=os.environ.get("SPLITSERVE_CACHE", d.cache_dir))
    parser.add_argument("--out", default=d.out, help="JSON report (logs go beside it)")
    args, up_args = parser.parse_known_args(argv)
    options = StackOptions(
        layouts=_names(args.layouts, LAYOUTS, "--layouts"),
        modes=_names(args.modes, MODES, "--modes"), seeds=tuple(range(args.seeds)),
        num_requests=args.num_requests, concurrency=args.concurrency,
        max_tokens=args.max_tokens, min_prompt_tokens=args.min_prompt_tokens,
        max_prompt_tokens=args.max_prompt_tokens, threads=args.threads,
        chunk_size=args.chunk_size, repeats=args.repeats, max_others=args.max_others,
        attempts=args.attempts, cache_dir=args.cache_dir,
        out=args.out, extra_args=tuple(a for a in up_args if a != "--"))
    _check(options)
    return options


def _names(text: str, known: dict, flag: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"{flag}: unknown {unknown or 'empty list'}; known: {', '.join(known)}")
    return names


def _check(options: StackOptions) -> None:
    problems = [(options.seeds, "--seeds must be >= 1"),
                (options.num_requests >= 1, "--num-requests must be >= 1"),
                (options.concurrency >= 1, "--concurrency must be >= 1"),
                (options.max_tokens >= 1, "--max-tokens must be >= 1"),
                (1 <= options.min_prompt_tokens <= options.max_prompt_tokens,
                 "need 1 <= --min-prompt-tokens <= --max-prompt-tokens"),
                (options.threads >= 1, "--threads must be >= 1"),
                (options.attempts >= 1, "--attempts must be >= 1"),
                (options.chunk_size >= options.concurrency, "--chunk-size must hold a decode "
                                                            "token per stream")]
    for ok, message in problems:
        if not ok:
            raise SystemExit(f"splitserve bench stack-ceiling: {message}")


def engine_settings(options: StackOptions) -> EngineSettings:
    return EngineSettings(cache_dir=options.cache_dir, threads=options.threads,
                          batch=options.concurrency, context=options.decode_context,
                          chunk_size=options.chunk_size, repeats=options.repeats,
                          max_others=options.max_others, attempts=options.attempts,
                          quiet_timeout_s=options.quiet_timeout_s)


def workloads(options: StackOptions) -> dict[int, list]:
    """Per seed: num_requests bench-range ShareGPT prompts in the prompt-token range (first
    turns, then later rounds with their history), max_tokens each."""
    from bench.run import BenchOptions, load_tokenizer
    from bench.workload import sample_sharegpt_requests

    tokenizer = load_tokenizer(BenchOptions(cache_dir=options.cache_dir))
    return {seed: sample_sharegpt_requests(
        tokenizer, options.num_requests, options.max_tokens, seed,
        max_prompt_tokens=options.max_prompt_tokens, min_prompt_tokens=options.min_prompt_tokens,
        use_reference_lengths=False, with_history=True) for seed in options.seeds}


def up_args(layout: str, model_dir: str, options: StackOptions) -> list[str]:
    return [*LAYOUTS[layout], "--model", model_dir, "--threads-per-instance",
            str(options.threads), "--chunk-size", str(options.chunk_size),
            "--max-num-batched-tokens", str(options.chunk_size), "--kv-memory-gib", "0.5",
            *options.extra_args]


def _pids(cluster) -> dict[str, int]:
    pids = {"client": os.getpid(), "gateway": cluster.process.pid}
    pids.update({row["instance_id"]: row["pid"] for row in cluster.cluster()["instances"]})
    return pids


def one_run(cluster, engine: EngineAlone, requests: list, mode: str,
            options: StackOptions) -> dict:
    """The engine alone, then the load, measured; both again (up to `attempts` in all) while
    other load disturbs the served run."""
    pids, disturbed = _pids(cluster), []
    for _ in range(options.attempts):
        alone = engine.measure()
        cpu_share.wait_for_quiet(pids, options.max_others, options.quiet_timeout_s)
        run = _measured_load(cluster, requests, mode, options, pids)
        if (run["cpu_share"][cpu_share.OTHERS] or 0.0) <= options.max_others:
            break
        disturbed.append(run["cpu_share"][cpu_share.OTHERS])
        print(f"  disturbed (others {disturbed[-1]:.2f} cores), measuring again", flush=True)
    return {**run, "engine_alone": alone, "disturbed_attempts": disturbed}


def _measured_load(cluster, requests: list, mode: str, options: StackOptions,
                   pids: dict[str, int]) -> dict:
    from bench.client import run_closed_loop
    from bench.metrics import resource_usage, run_duration, summarize

    before_cluster = cluster.cluster()
    before, started = cpu_share.reading(pids), time.perf_counter()
    records = asyncio.run(run_closed_loop(cluster.url, cluster.model(), requests,
                                          options.concurrency, ignore_eos=True, **MODES[mode]))
    wall_s = time.perf_counter() - started
    shares = cpu_share.cpu_shares(before, cpu_share.reading(pids), wall_s)
    summary = summarize(records, run_duration(records))
    busy = resource_usage(before_cluster, cluster.cluster())["per_instance"]
    return {"mode": mode, "wall_s": wall_s,
            "served_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
            "cpu_share": shares, "cpu_us_per_token": stack_report.us_per_token(
                shares, wall_s, summary["total_output_tokens"]),
            "busy_share": {n: s / wall_s for n, s in busy.items()}, **summary}


def serve_layout(layout: str, engine: EngineAlone, model_dir: str, loads: dict[int, list],
                 options: StackOptions) -> list[dict]:
    from bench.client import run_closed_loop
    from bench.cluster import ClusterProcess

    out = Path(options.out)
    log = out.parent / f"{out.stem}-logs" / f"{_slug(layout)}.log"
    runs = []
    with ClusterProcess(up_args(layout, model_dir, options), log) as cluster:
        warm = loads[options.seeds[0]][:options.concurrency]
        for mode in options.modes:  # first forwards of each shape and sampler path
            asyncio.run(run_closed_loop(cluster.url, cluster.model(), warm, options.concurrency,
                                        ignore_eos=True, **MODES[mode]))
        for seed in options.seeds:
            for mode in options.modes:
                run = {"layout": layout, "seed": seed,
                       **one_run(cluster, engine, loads[seed], mode, options)}
                runs.append(run)
                print(f"{layout} {mode} seed {seed}: {_run_line(run)}", flush=True)
    return runs


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).lower()


def _run_line(run: dict) -> str:
    us = run["cpu_us_per_token"]
    cores = ", ".join(f"{n} {s:.2f}" + (f" ({us[n]:.0f} us/tok)" if us.get(n) else "")
                      for n, s in run["cpu_share"].items() if s is not None)
    return (f"{run['served_tokens_per_s']:.0f} output tok/s (engine alone "
            f"{run['engine_alone']['greedy_tokens_per_s']:.0f} greedy, "
            f"{run['engine_alone']['sampled_tokens_per_s']:.0f} sampled), "
            f"{run['num_errors']} errors; CPU cores: {cores}")


def run_stack_ceiling(options: StackOptions) -> dict:
    loads = workloads(options)
    with EngineAlone(engine_settings(options)) as engine:
        model_dir = engine.measure()["model_dir"]  # builds the model on the first run
        runs = [run for layout in options.layouts
                for run in serve_layout(layout, engine, model_dir, loads, options)]
    rows = stack_report.aggregate(runs)
    prompt_tokens = [r.num_prompt_tokens for load in loads.values() for r in load]
    report = {"options": asdict(options), "cpu": _cpu_name(), "cores": os.cpu_count(),
              "model_dir": model_dir, "mean_prompt_tokens": statistics.mean(prompt_tokens),
              "rows": rows, "runs": runs}
    out = Path(options.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(stack_report.table(rows))
    print(f"wrote {out}")
    return report


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(argv: list[str] | None = None) -> None:
    run_stack_ceiling(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
