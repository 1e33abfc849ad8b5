"""The decode scheduling experiments of TetriInfer §5 on real instances.

intra (Fig. 18): one decode instance whose KV pool is small enough to constrain it; N ShareGPT
    requests (each asks for its reference reply length, ignore-EOS, all sent at once); decode
    admission greedy vs reserve-static vs reserve-dynamic, with true lengths (the oracle
    predictor at granularity 1) and, given `--predictor DIR`, with a trained predictor. Reports
    mean JCT and the decode instance's preemptions.
inter (Fig. 19): K decode instances, 32 requests per instance, power-of-two (ours, and the
    paper's literal heavy:light ratio rule) vs random vs round robin vs imbalance (`--policies`;
    oracle buckets of 200 tokens, heavy = over 128). Reports the total decoding time
    (first admission to last finish over all decode instances) and the heavy/light counts of the
    slowest instance.

    python -m bench.decode_experiments intra --out results/decode_intra
    python -m bench.decode_experiments inter --decodes 2 --out results/decode_inter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.client import run_load
from bench.cluster import ClusterProcess
from bench.machine import cpu_kind
from bench.run import BenchOptions, load_tokenizer
from bench.workload import BenchRequest, sample_sharegpt_requests
from common.config import ConfigError
from common.sharegpt import normalize_prompt
from length_predictor.base import read_meta


@dataclass(frozen=True)
class DecodeExperimentOptions:
    experiment: str = "intra"
    num_requests: int = 256  # intra; inter uses 32 per decode instance
    decodes: int = 2  # inter
    max_tokens: int = 256  # cap on the reference reply length
    max_prompt_tokens: int = 512
    decode_blocks: int = 160  # intra: the constrained KV pool (blocks of 16 tokens)
    predictor: str | None = None  # a trained predictor directory (intra, "predicted" series)
    seed: int = 0
    policies: str = "power_of_two,power_of_two_ratio,random,round_robin,imbalance"  # inter
    # intra: which lengths:admission runs, comma-separated ("" = all six). Greedy ignores the
    # lengths, so "true:greedy" alone serves as both series' baseline when runs are dear.
    runs: str = ""
    extra_args: tuple[str, ...] = ()
    out: str = "results/decode_experiments"


def _workload(options: DecodeExperimentOptions, count: int) -> list[BenchRequest]:
    tokenizer = load_tokenizer(BenchOptions())
    return sample_sharegpt_requests(tokenizer, count, options.max_tokens, options.seed,
                                    max_prompt_tokens=options.max_prompt_tokens)


def predictor_overlap(predictor: str, requests: list[BenchRequest]) -> dict:
    """How many of the workload's prompts the predictor was trained or scored on, from the
    dataset its predictor.json names (its train.jsonl and eval.jsonl). Raises ConfigError when
    any is: a predictor must never have seen the workload it is measured on."""
    dataset = Path(read_meta(predictor).dataset)
    files = [dataset / f"{part}.jsonl" for part in ("train", "eval")]
    if not all(f.is_file() for f in files):
        return {"dataset": str(dataset), "checked": False}
    seen = {normalize_prompt(json.loads(line)["prompt"]) for f in files
            for line in f.read_text().splitlines() if line.strip()}
    overlap = sum(normalize_prompt(r.prompt) in seen for r in requests)
    if overlap:
        raise ConfigError(f"{overlap} of the {len(requests)} workload prompts are in the "
                          f"predictor's dataset {dataset}: train it on the split's train range")
    return {"dataset": str(dataset), "checked": True, "dataset_prompts": len(seen),
            "workload_prompts_seen": 0}


def _run(args: list[str], requests: list[BenchRequest], log: Path) -> tuple[list, dict]:
    with ClusterProcess(args, log) as cluster:
        records = asyncio.run(run_load(cluster.url, cluster.model(), requests,
                                       [0.0] * len(requests), ignore_eos=True, progress=False))
        return records, cluster.cluster()


def _error_counts(records: list) -> dict[str, int]:
    """Failed requests by error message (its first 100 characters)."""
    return dict(Counter(str(r.error)[:100] for r in records if r.error is not None))


def _decodes(view: dict) -> list[dict]:
    return [i for i in view["instances"] if i["role"] == "decode"]


INTRA_ADMISSIONS = ("greedy", "reserve-static", "reserve-dynamic")


def intra_runs(options: DecodeExperimentOptions) -> list[tuple[str, str]]:
    """The (lengths, admission) pairs to run, in the order they run."""
    lengths = ("true", "predicted") if options.predictor else ("true",)
    every = [(length, admission) for length in lengths for admission in INTRA_ADMISSIONS]
    if not options.runs:
        return every
    chosen = [tuple(run.split(":", 1)) for run in options.runs.split(",")]
    unknown = [":".join(run) for run in chosen if run not in every]
    if unknown:
        raise ConfigError(f"unknown intra runs {', '.join(unknown)}; known: "
                          f"{', '.join(':'.join(run) for run in every)}")
    return [run for run in every if run in chosen]


def intra(options: DecodeExperimentOptions, requests: list[BenchRequest]) -> list[dict]:
    predictor_args = {"true": ["--predictor", "oracle", "--oracle-granularity", "1"],
                      "predicted": ["--predictor", str(options.predictor)]}
    rows = []
    for label, admission in intra_runs(options):
        args = ["--num-blocks", str(options.decode_blocks), "--decode-admission", admission,
                *predictor_args[label], *options.extra_args]
        records, view = _run(args, requests, Path(options.out) / f"{label}-{admission}.log")
        ok = [r for r in records if r.error is None]
        rows.append({"lengths": label, "admission": admission, "num_ok": len(ok),
                     "errors": _error_counts(records),
                     "mean_jct_s": statistics.mean(r.jct for r in ok) if ok else None,
                     "preemptions": sum(d["decodes"]["preemptions"] for d in _decodes(view))})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def inter(options: DecodeExperimentOptions) -> list[dict]:
    requests = _workload(options, 32 * options.decodes)
    rows = []
    for policy in options.policies.split(","):
        args = ["--decode", str(options.decodes), "--dispatch-policy", policy, "--predictor",
                "oracle", "--oracle-granularity", "200", *options.extra_args]
        records, view = _run(args, requests, Path(options.out) / f"{policy}.log")
        decodes = [d for d in _decodes(view) if d["decodes"]["first_admit_time"]]  # served some
        start = min(d["decodes"]["first_admit_time"] for d in decodes)
        slowest = max(decodes, key=lambda d: d["decodes"]["last_finish_time"])
        rows.append({"policy": policy, "num_ok": sum(r.error is None for r in records),
                     "errors": _error_counts(records),
                     "total_decoding_time_s": slowest["decodes"]["last_finish_time"] - start,
                     "slowest_instance": slowest["instance_id"],
                     "slowest_heavy": slowest["decodes"]["finished_heavy"],
                     "slowest_light": slowest["decodes"]["finished_light"],
                     "per_instance": {d["instance_id"]: d["decodes"] for d in decodes}})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_instance"}),
              flush=True)
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if result["options"]["experiment"] == "intra":
        labels = [f"{r['lengths']}\n{r['admission']}" for r in rows]
        axes[0].bar(labels, [r["mean_jct_s"] or 0 for r in rows])
        axes[0].set(ylabel="mean JCT (s)", title="Intra-decode admission (Fig. 18)")
        axes[1].bar(labels, [r["preemptions"] for r in rows], color="tab:red")
        axes[1].set(ylabel="preemptions", title="decode instance preemptions")
    else:
        labels = [r["policy"] for r in rows]
        axes[0].bar(labels, [r["total_decoding_time_s"] for r in rows])
        axes[0].set(ylabel="total decoding time (s)", title="Inter-decode placement (Fig. 19)")
        axes[1].bar(labels, [r["slowest_heavy"] for r in rows], label="heavy")
        axes[1].bar(labels, [r["slowest_light"] for r in rows],
                    bottom=[r["slowest_heavy"] for r in rows], label="light")
        axes[1].set(ylabel="requests", title="slowest instance's mix")
        axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_decode_experiment(options: DecodeExperimentOptions) -> dict:
    checks = {}
    if options.experiment == "intra":
        intra_runs(options)  # before any run: fail fast
        requests = _workload(options, options.num_requests)
        if options.predictor:
            checks["predictor_overlap"] = predictor_overlap(options.predictor, requests)
            print(json.dumps(checks), flush=True)
        rows = intra(options, requests)
    else:
        rows = inter(options)
    result = {"options": asdict(options), "machine": {"cpu": cpu_kind()}, "rows": rows, **checks}
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{options.experiment}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"{options.experiment}.png")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment", choices=["intra", "inter"])
    for name, value in asdict(DecodeExperimentOptions()).items():
        if name not in ("experiment", "extra_args", "predictor"):
            parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    parser.add_argument("--predictor", default=None)
    known, up_args = parser.parse_known_args()  # the rest go to `splitserve up`
    args = vars(known)
    args["extra_args"] = tuple(a for a in up_args if a != "--")
    run_decode_experiment(DecodeExperimentOptions(**args))


if __name__ == "__main__":
    main()
