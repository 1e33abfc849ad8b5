"""`splitserve bench`: options, the end-to-end benchmark run, its JSON report and summary table.

The CLI owner wires the command with `add_bench_args(subparser)` and
`run_bench(options_from_args(args))`. Workloads: `sharegpt` (first turns of the bench range of
the ShareGPT split, one completion each) and `multiturn` (bench.multiturn: conversations replayed
turn by turn as chat completions carrying the server's own earlier answers; the report adds TTFT
by turn index). The tokenizer is loaded only to count tokens, from the
served model's files (resolving a GGUF file converts it in a child process, so this process never
imports torch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import multiturn
from bench.client import RequestRecord, run_load, served_model
from bench.metrics import run_duration, summarize
from bench.workload import BenchRequest, gamma_arrivals, poisson_arrivals, sample_sharegpt_requests
from common.config import ConfigError
from common.model_files import resolve_model
from common.tokenizer import TextTokenizer

ARRIVALS = ("poisson", "gamma")
WORKLOADS = ("sharegpt", "multiturn")


@dataclass(frozen=True)
class BenchOptions:
    """One benchmark run against an OpenAI-compatible server."""

    url: str = "http://127.0.0.1:8000"
    workload: str = "sharegpt"
    # Served model name; None = the first id listed by /v1/models.
    model: str | None = None
    # Model file or directory used only to count tokens; None = the default model.
    tokenizer_path: str | None = None
    cache_dir: str = "~/.cache/splitserve"
    num_requests: int = 50  # multiturn: conversations
    rate: float = 2.0  # requests/s (multiturn: conversation starts/s); inf = all at once
    arrival: str = "poisson"
    cv: float = 1.0  # gamma arrivals only
    max_tokens: int = 128
    max_prompt_tokens: int = 1024
    # True: each request asks for its ShareGPT reply's length, capped at max_tokens.
    use_reference_lengths: bool = True
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    out: str = "results/bench.json"
    # multiturn only (bench.multiturn.MultiTurnOptions)
    max_turns: int = 4
    think_time_s: float = 1.0
    think_time_dist: str = "exponential"
    max_history_tokens: int = 1500

    def __post_init__(self) -> None:
        checks = [
            (self.workload in WORKLOADS,
             f"workload must be one of {WORKLOADS}, got {self.workload!r}"),
            (self.num_requests >= 1, f"num_requests must be >= 1, got {self.num_requests}"),
            (self.rate > 0, f"rate must be > 0 (inf = all at once), got {self.rate}"),
            (self.arrival in ARRIVALS, f"arrival must be one of {ARRIVALS}, got {self.arrival!r}"),
            (self.cv > 0, f"cv must be > 0, got {self.cv}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.max_prompt_tokens >= 4,
             f"max_prompt_tokens must be >= 4, got {self.max_prompt_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.workload == "multiturn":
            multiturn.settings_of(self)  # raises ConfigError on bad multiturn settings


def load_tokenizer(options: BenchOptions) -> TextTokenizer:
    """The tokenizer of the model named by options.tokenizer_path (None = the default model)."""
    resolved = resolve_model(options.tokenizer_path, Path(options.cache_dir).expanduser(),
                             in_subprocess=True)
    return TextTokenizer(resolved.hf_dir)


def build_workload(options: BenchOptions, tokenizer: TextTokenizer
                   ) -> tuple[list[BenchRequest], list[float]]:
    """The requests and their arrival offsets, both reproducible from options.seed."""
    requests = sample_sharegpt_requests(
        tokenizer, options.num_requests, options.max_tokens, options.seed,
        max_prompt_tokens=options.max_prompt_tokens,
        use_reference_lengths=options.use_reference_lengths)
    return requests, _arrivals(options, len(requests))


def _arrivals(options: BenchOptions, count: int) -> list[float]:
    if options.arrival == "gamma":
        return gamma_arrivals(count, options.rate, options.cv, options.seed)
    return poisson_arrivals(count, options.rate, options.seed)


def _multiturn_report(options: BenchOptions, tokenizer: TextTokenizer) -> dict:
    """Plan the conversations, replay them, and report every turn (bench.multiturn)."""
    settings = multiturn.settings_of(options)
    conversations = multiturn.plan_conversations(tokenizer, options.num_requests, settings,
                                                 options.seed)
    arrivals = _arrivals(options, len(conversations))
    model = options.model or asyncio.run(served_model(options.url))
    records = asyncio.run(multiturn.run_conversations(
        options.url, model, conversations, arrivals, settings.max_history_tokens,
        ignore_eos=options.ignore_eos, temperature=options.temperature))
    options_dict = {key: _json_safe(value) for key, value in asdict(options).items()}
    return multiturn.build_report(options_dict, model, conversations, arrivals, records)


async def _load(options: BenchOptions, requests: list[BenchRequest],
                arrivals: list[float]) -> tuple[str, list[RequestRecord]]:
    model = options.model or await served_model(options.url)
    records = await run_load(options.url, model, requests, arrivals, ignore_eos=options.ignore_eos,
                             temperature=options.temperature)
    return model, records


def _json_safe(value: float) -> float | str:
    # json.dumps would write Infinity, which strict JSON readers reject.
    return str(value) if isinstance(value, float) and math.isinf(value) else value


def build_report(options: BenchOptions, model: str, requests: list[BenchRequest],
                 arrivals: list[float], records: list[RequestRecord]) -> dict:
    """The JSON report: options, summary, and one entry per request (without prompt text)."""
    per_request = []
    for request, arrival, record in zip(requests, arrivals, records):
        entry = {"arrival": arrival, "num_prompt_tokens": request.num_prompt_tokens,
                 "max_tokens": request.max_tokens,
                 "reference_output_tokens": request.reference_output_tokens}
        per_request.append(entry | asdict(record))
    options_dict = {key: _json_safe(value) for key, value in asdict(options).items()}
    return {"options": options_dict, "model": model,
            "summary": summarize(records, run_duration(records)), "requests": per_request}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_summary(summary: dict) -> str:
    """A short table: latency mean/p50/p99 in ms, then throughput."""
    lines = [f"{summary['num_ok']} ok, {summary['num_errors']} errors of "
             f"{summary['num_requests']} requests in {summary['duration_s']:.2f} s",
             f"{'(ms)':<6}{'mean':>10}{'p50':>10}{'p99':>10}"]
    for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("JCT", "jct_s"), ("TBT", "tbt_s")):
        row = summary[key]
        lines.append(f"{name:<6}{_ms(row.get('mean')):>10}{_ms(row['p50']):>10}"
                     f"{_ms(row['p99']):>10}")
    rates = summary["throughput"]
    lines.append(f"throughput: {_rate(rates['requests_per_s'])} req/s, "
                 f"{_rate(rates['output_tokens_per_s'])} output tok/s, "
                 f"{_rate(rates['total_tokens_per_s'])} total tok/s")
    lines += [f"error x{count}: {message}" for message, count in summary["errors"].items()]
    if "by_turn" in summary:
        lines.append(multiturn.format_by_turn(summary))
    return "\n".join(lines)


def run_bench(options: BenchOptions) -> dict:
    """Build the workload, replay it, write options.out and print the summary table."""
    tokenizer = load_tokenizer(options)
    if options.workload == "multiturn":
        report = _multiturn_report(options, tokenizer)
    else:
        requests, arrivals = build_workload(options, tokenizer)
        model, records = asyncio.run(_load(options, requests, arrivals))
        report = build_report(options, model, requests, arrivals, records)
    out = Path(options.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(format_summary(report["summary"]))
    print(f"wrote {out}")
    return report


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """The `splitserve bench` flags; defaults come from BenchOptions."""
    d = BenchOptions()
    parser.add_argument("--url", default=d.url, help="server base URL (default: %(default)s)")
    parser.add_argument("--workload", choices=WORKLOADS, default=d.workload,
                        help="sharegpt: first turns, one completion each; multiturn: "
                             "conversations replayed turn by turn as chat completions "
                             "(default: %(default)s)")
    parser.add_argument("--model", default=d.model,
                        help="served model name (default: the first one in /v1/models)")
    parser.add_argument("--tokenizer", dest="tokenizer_path", default=d.tokenizer_path,
                        help="model file or directory used to count tokens (default: the "
                             "default model)")
    parser.add_argument("--cache-dir", default=d.cache_dir,
                        help="where converted models are cached (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=d.num_requests,
                        help="requests (multiturn: conversations) (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=d.rate,
                        help="requests (multiturn: conversation starts) per second; inf sends "
                             "all at once (default: %(default)s)")
    parser.add_argument("--arrival", choices=ARRIVALS, default=d.arrival)
    parser.add_argument("--cv", type=float, default=d.cv,
                        help="coefficient of variation of gamma inter-arrivals")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens,
                        help="output cap per request (default: %(default)s)")
    parser.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    parser.add_argument("--no-reference-lengths", action="store_true",
                        help="ask every request for --max-tokens instead of its ShareGPT "
                             "reply's length")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--out", default=d.out, help="JSON report path (default: %(default)s)")
    add_multiturn_args(parser, d)


def add_multiturn_args(parser: argparse.ArgumentParser, defaults) -> None:
    """The multiturn workload's flags (`splitserve bench` and `bench compare`)."""
    group = parser.add_argument_group("multiturn workload")
    group.add_argument("--max-turns", type=int, default=defaults.max_turns,
                       help="user turns per conversation at most (default: %(default)s)")
    group.add_argument("--think-time", dest="think_time_s", type=float,
                       default=defaults.think_time_s,
                       help="mean seconds between an answer and the next turn (default: "
                            "%(default)s)")
    group.add_argument("--think-time-dist", choices=multiturn.THINK_TIMES,
                       default=defaults.think_time_dist)
    group.add_argument("--max-history-tokens", type=int, default=defaults.max_history_tokens,
                       help="prompt cap: the oldest turns are left out (default: %(default)s)")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """BenchOptions from the flags add_bench_args defined."""
    return BenchOptions(
        url=args.url, model=args.model, tokenizer_path=args.tokenizer_path,
        cache_dir=args.cache_dir, num_requests=args.num_requests, rate=args.rate,
        arrival=args.arrival, cv=args.cv, max_tokens=args.max_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        use_reference_lengths=not args.no_reference_lengths, ignore_eos=args.ignore_eos,
        temperature=args.temperature, seed=args.seed, out=args.out, workload=args.workload,
        **multiturn_fields(args))


def multiturn_fields(args: argparse.Namespace) -> dict:
    """The options `add_multiturn_args` defined, by their field names."""
    return {"max_turns": args.max_turns, "think_time_s": args.think_time_s,
            "think_time_dist": args.think_time_dist,
            "max_history_tokens": args.max_history_tokens}
