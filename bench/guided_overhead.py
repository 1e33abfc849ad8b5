"""`splitserve bench guided-overhead`: what guided decoding adds to a decode step.

Owns: the benchmark's options, the timed steps and the JSON report. One process, the default
model (or --model), its runner alone (no scheduler, no sockets):

1. A decode step at `--batch` (default 32) sequences, each with `--context` tokens cached,
   timed unconstrained and with every row constrained by a JSON schema, alternately (this VM's
   speed drifts between minutes, so the two are compared step by step), `--repeats` times each
   after a warm-up, per sampling mode (greedy; sampled at temperature 0.7, top_p 0.95).
2. Each constrained step starts from fresh matchers advanced part-way into a valid document
   (row i by its first 3i mod (length + 1) tokens), so the rows sit in different grammar
   states: between keys, in strings, in numbers, at the end (EOS only).
3. The mask alone: `guided.constrain` and `guided.advance` on [batch, vocab] logits, each
   timed by itself.

Reports the medians and constrained / unconstrained (issue 22's target: at most 1.2), with
the CPU kind and the load average (other processes on a shared machine show there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer"},
    "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "email", "tags", "address"]}
# A document of SCHEMA, its properties in the schema's order (the grammar keeps that order).
DOCUMENT = {"name": "Alice Martin", "age": 42, "email": "alice@example.com",
            "tags": ["admin", "ops"], "address": {"city": "Lyon", "zip": "69001"}}
MODES = ("greedy", "sampled")


@dataclass(frozen=True)
class Options:
    batch: int = 32
    context: int = 128
    repeats: int = 20
    modes: tuple[str, ...] = MODES
    threads: int | None = None  # torch threads; None: torch's default
    model: str | None = None  # None: the default model
    cache_dir: str = "~/.cache/splitserve"
    out: str = "docs/benchmarks/guided_overhead/guided_overhead.json"


def parse_args(argv: list[str] | None = None) -> Options:
    d = Options()
    parser = argparse.ArgumentParser(prog="splitserve bench guided-overhead",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=d.batch)
    parser.add_argument("--context", type=int, default=d.context,
                        help="tokens in each sequence's cache")
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--modes", default=",".join(d.modes), help="of: greedy, sampled")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--cache-dir", default=os.environ.get("SPLITSERVE_CACHE", d.cache_dir))
    parser.add_argument("--out", default=d.out)
    args = parser.parse_args(argv)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or set(modes) - set(MODES) or args.batch < 1 or args.repeats < 1:
        raise SystemExit("splitserve bench guided-overhead: need --batch >= 1, --repeats >= 1 "
                         f"and --modes of {', '.join(MODES)}")
    return Options(args.batch, args.context, args.repeats, modes, args.threads, args.model,
                   args.cache_dir, args.out)


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Setup:
    """The runner, a decode plan at the batch, the compiled schema and the document's tokens."""

    def __init__(self, options: Options) -> None:
        from common.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
        from common.engine import guided
        from common.engine.model_runner import ModelRunner
        from common.engine.profile import _Bench
        from common.sampling_params import GuidedSpec
        from common.tokenizer import TextTokenizer

        blocks = options.batch * -(-(options.context + 1) // 16) + 16
        self.runner = ModelRunner(EngineConfig(
            model=ModelConfig(path=options.model, cache_dir=options.cache_dir,
                              num_threads=options.threads),
            cache=CacheConfig(block_size=16, num_blocks=blocks),
            batch=BatchConfig(max_num_seqs=options.batch,
                              max_num_batched_tokens=max(options.batch, 512))))
        self.plan, self.release = _Bench(self.runner).decode_plan(options.batch, options.context)
        tokenizer = TextTokenizer(self.runner.resolved.hf_dir)
        self.eos_ids = tokenizer.eos_token_ids
        self.document = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
        self.compiler = guided.compiler_for_runner(self.runner)
        started = time.perf_counter()
        self.compiled = self.compiler.submit(GuidedSpec("json", json.dumps(SCHEMA))).result()
        self.first_compile_s = time.perf_counter() - started  # the tokenizer's info included

    def params(self, mode: str):
        import msgspec

        from common.engine.profile import GREEDY, SAMPLED

        return msgspec.structs.replace(GREEDY if mode == "greedy" else SAMPLED,
                                       eos_token_ids=self.eos_ids)

    def fresh_guides(self, params) -> list:
        """One matcher per row, row i advanced by the document's first 3i mod (length + 1)
        tokens."""
        guides = []
        for row in range(len(self.plan.chunks)):
            guide = self.compiled.matcher(params)
            guide.accept_all(self.document[:(3 * row) % (len(self.document) + 1)])
            guides.append(guide)
        return guides

    def chunks(self, params, guides=None) -> list:
        guides = guides or [None] * len(self.plan.chunks)
        return [replace(c, sampling=params, guide=g) for c, g in zip(self.plan.chunks, guides)]


def measure_steps(setup: Setup, mode: str, repeats: int) -> dict:
    """Unconstrained and constrained decode steps, alternately; medians and their ratio."""
    from common.plan import BatchPlan

    params = setup.params(mode)
    plain = BatchPlan(setup.chunks(params))
    constrained = lambda: BatchPlan(setup.chunks(params, setup.fresh_guides(params)))
    setup.runner.execute(plain)  # warm-up, both paths
    setup.runner.execute(constrained())
    plain_s, guided_s = [], []
    for _ in range(repeats):
        plain_s.append(_seconds(lambda: setup.runner.execute(plain)))
        plan = constrained()  # matchers made outside the timed step
        guided_s.append(_seconds(lambda plan=plan: setup.runner.execute(plan)))
    median_plain, median_guided = statistics.median(plain_s), statistics.median(guided_s)
    return {"unconstrained_step_s": median_plain, "constrained_step_s": median_guided,
            "ratio": median_guided / median_plain,
            # each constrained step over the unconstrained one just before it: less exposed to
            # the machine's drift than the ratio of medians
            "paired_ratio": statistics.median(g / p for g, p in zip(guided_s, plain_s)),
            "unconstrained_samples_s": plain_s, "constrained_samples_s": guided_s}


def measure_mask(setup: Setup, repeats: int) -> dict:
    """Median seconds of the mask alone over the batch's rows: `guided.constrain` (bitmask
    filled and applied) and `guided.advance` (each matcher takes its row's token)."""
    import torch

    from common.engine import guided

    params = setup.params("greedy")
    vocab = setup.runner.model.shape.vocab_size
    logits = torch.randn(len(setup.plan.chunks), vocab, generator=torch.Generator().manual_seed(0))
    constrain_s, advance_s = [], []
    for _ in range(repeats + 1):
        chunks, step = setup.chunks(params, setup.fresh_guides(params)), logits.clone()
        constrain_s.append(_seconds(lambda c=chunks, s=step: guided.constrain(s, c, None)))
        tokens = step.argmax(dim=-1).tolist()  # allowed ones; not timed
        advance_s.append(_seconds(lambda c=chunks, t=tokens: guided.advance(c, t)))
    # the first of each warms up
    return {"constrain_s": statistics.median(constrain_s[1:]),
            "advance_s": statistics.median(advance_s[1:])}


def run(options: Options) -> dict:
    from bench.machine import cpu_kind

    setup = Setup(options)
    try:
        import torch

        report = {"options": asdict(options), "cpu": cpu_kind(), "dtype": setup.runner.dtype_name,
                  "torch_threads": torch.get_num_threads(), "model": setup.runner.resolved.name,
                  "vocab_size": setup.runner.model.shape.vocab_size, "schema": SCHEMA,
                  "document_tokens": len(setup.document),
                  "first_compile_s": setup.first_compile_s, "load_average_before": os.getloadavg()}
        report["modes"] = {mode: measure_steps(setup, mode, options.repeats)
                           for mode in options.modes}
        report["mask_only"] = measure_mask(setup, options.repeats)
        report["load_average_after"] = os.getloadavg()
        return report
    finally:
        setup.release()
        setup.compiler.close()


def summary(report: dict) -> str:
    lines = [(f"{report['cpu']['kind']}; {report['model']} {report['dtype']}, "
              f"{report['torch_threads']} torch threads, batch {report['options']['batch']}, "
              f"context {report['options']['context']}, load average "
              f"{report['load_average_before'][0]:.1f} -> "
              f"{report['load_average_after'][0]:.1f}")]
    for mode, m in report["modes"].items():
        lines.append(f"{mode:8s} unconstrained {m['unconstrained_step_s'] * 1e3:8.1f} ms   "
                     f"constrained {m['constrained_step_s'] * 1e3:8.1f} ms   "
                     f"ratio {m['ratio']:.3f} (paired {m['paired_ratio']:.3f}; target <= 1.2)")
    mask = report["mask_only"]
    lines.append(f"mask alone, {report['options']['batch']} rows: constrain "
                 f"{mask['constrain_s'] * 1e3:.2f} ms, advance {mask['advance_s'] * 1e3:.2f} ms; "
                 f"first compile (tokenizer info included) {report['first_compile_s']:.2f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    report = run(options)
    out = Path(options.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
