"""What the predictor costs the main model: prefill latency and throughput with vs without it.

One process, one burst of ShareGPT prompts (first turns of the split's eval range), two passes
over the same prompts (TetriInfer Fig. 17):

    without:  main-model prefill only
    with:     the same prefill while the predictor works beside it —
              token kinds: a `PredictorService` (parallel: its thread; sequential: before)
              hidden-state kinds: `from_hidden` on each forward's `ModelOutput.hidden`

Prefill follows the prefill instance: prompts are sliced and merged, in order, into chunks of
ChunkSize tokens, one forward per chunk; a sequence's KV blocks are freed once its prompt is
done. Every prompt arrives at t=0, so a prompt's latency is the time its last chunk finishes.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from common.block_pool import KVCacheManager
from common.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from common.plan import BatchPlan, ScheduledChunk
from common.sampling_params import SamplingParams
from length_predictor.base import LengthPredictor
from length_predictor.serving import PredictorService, ServiceOptions

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass(frozen=True)
class OverheadOptions:
    num_prompts: int = 64
    chunk_size: int = 256  # main-model tokens per prefill forward (ChunkSize)
    max_prompt_tokens: int = 2048  # longer ShareGPT prompts are cut (keeps one run short)
    seed: int = 0
    # Passes of each kind, alternating (without, with, with, without, ...); medians reported.
    # NOTE: on a shared CPU single passes move by 10-20%; alternating cancels slow drifts.
    repeats: int = 3
    service: ServiceOptions = field(default_factory=ServiceOptions)


@dataclass
class PrefillRun:
    total_seconds: float = 0.0
    num_tokens: int = 0
    forward_seconds: list[float] = field(default_factory=list)
    request_seconds: list[float] = field(default_factory=list)  # t=0 -> prompt's last chunk

    def summary(self) -> dict:
        return {"mean_request_latency_s": statistics.fmean(self.request_seconds),
                "mean_forward_latency_s": statistics.fmean(self.forward_seconds),
                "throughput_tok_s": self.num_tokens / self.total_seconds,
                "total_s": self.total_seconds, "num_forwards": len(self.forward_seconds)}


def sharegpt_prompts(tokenizer, options: OverheadOptions) -> list[list[int]]:
    """Seeded first turns of the split's eval range: prompts the predictor never trained on."""
    from common.sharegpt import load_split
    from length_predictor.dataset import chat_prompt

    pairs = load_split()["eval"].first_turns
    chosen = random.Random(options.seed).sample(pairs, min(options.num_prompts, len(pairs)))
    return [chat_prompt(tokenizer, text)[:options.max_prompt_tokens] for _, text, _ in chosen]


def _chunks(prompts: list[list[int]], chunk_size: int):
    """Yield (seq index, start, end) slices merged into forwards of at most chunk_size tokens."""
    forward, used = [], 0
    for index, prompt in enumerate(prompts):
        start = 0
        while start < len(prompt):
            take = min(len(prompt) - start, chunk_size - used)
            forward.append((index, start, start + take))
            start, used = start + take, used + take
            if used == chunk_size:
                yield forward
                forward, used = [], 0
    if forward:
        yield forward


def run_prefill(runner, prompts: list[list[int]], chunk_size: int, on_hidden=None,
                started: float | None = None, hidden_layers: tuple[int, ...] = ()) -> PrefillRun:
    """Prefill every prompt in chunks; `on_hidden(ModelOutput.hidden)` (of `hidden_layers`)
    after each forward."""
    kv = KVCacheManager(runner.kv_layout.num_blocks, runner.kv_layout.block_size)
    run = PrefillRun(num_tokens=sum(map(len, prompts)))
    started = time.perf_counter() if started is None else started
    for forward in _chunks(prompts, chunk_size):
        chunks = []
        for index, start, end in forward:
            table = kv.grow(f"p{index}", end)
            last = end == len(prompts[index])
            chunks.append(ScheduledChunk(f"p{index}", prompts[index][start:end], start, table,
                                         _GREEDY if last else None))
        begun = time.perf_counter()
        output = runner.execute(BatchPlan(chunks, return_hidden=on_hidden is not None,
                                          hidden_layers=hidden_layers))
        now = time.perf_counter()
        run.forward_seconds.append(now - begun)
        if on_hidden is not None:
            on_hidden(output.hidden)
        for chunk in chunks:
            if chunk.sampling is not None:
                run.request_seconds.append(now - started)
                kv.free(chunk.seq_id)
    run.total_seconds = time.perf_counter() - started
    return run


def _with_predictor(runner, predictor: LengthPredictor, prompts, options: OverheadOptions):
    """One prefill pass with the predictor beside it; returns (PrefillRun, predictor info)."""
    with PredictorService(predictor, options.service) as service:
        started = time.perf_counter()
        if service.uses_hidden_states:
            found: dict = {}
            run = run_prefill(runner, prompts, options.chunk_size,
                              lambda hidden: found.update(service.from_hidden(hidden)), started,
                              service.hidden_layers)
            done = time.perf_counter()
        else:
            for index, prompt in enumerate(prompts):
                service.submit(f"p{index}", prompt)
            if options.service.mode == "sequential":
                found = service.poll()  # the predictor runs first, then the main model
            run = run_prefill(runner, prompts, options.chunk_size, started=started)
            if options.service.mode == "parallel":
                found = service.wait([f"p{i}" for i in range(len(prompts))])
            done = time.perf_counter()
        info = {"num_predicted": len(found), "predictor_busy_s": service.stats.busy_seconds,
                "all_predicted_at_s": done - started}
    return run, info


def measure_overhead(predictor: LengthPredictor, model: ModelConfig,
                     options: OverheadOptions) -> dict:
    """Prefill the same prompts without, then with, the predictor; both summaries and ratios."""
    from common.engine.model_runner import ModelRunner
    from common.tokenizer import TextTokenizer

    tokens = options.max_prompt_tokens + options.chunk_size
    config = EngineConfig(model=model, cache=CacheConfig(num_blocks=2 * tokens // 16 + 16),
                          batch=BatchConfig(max_num_batched_tokens=options.chunk_size))
    runner = ModelRunner(config)
    try:
        prompts = sharegpt_prompts(TextTokenizer(runner.resolved.hf_dir), options)
        run_prefill(runner, prompts[:4], options.chunk_size)  # warm-up: kernels, allocator
        if not predictor.uses_hidden_states:
            predictor.predict_tokens(prompts[:2])  # warm-up of the predictor's own model
        runs: dict[str, list[dict]] = {"without": [], "with": []}
        for repeat in range(options.repeats):
            order = ("without", "with") if repeat % 2 == 0 else ("with", "without")
            for name in order:
                if name == "without":
                    runs[name].append(run_prefill(runner, prompts, options.chunk_size).summary())
                else:
                    run, info = _with_predictor(runner, predictor, prompts, options)
                    runs[name].append({**run.summary(), **info})
    finally:
        runner.close()
    without, beside = _median(runs["without"]), _median(runs["with"])
    return {"predictor": {"kind": predictor.kind, "granularity": predictor.granularity,
                          "mode": options.service.mode},
            "runs": runs,
            "options": asdict(options), "num_prompt_tokens": sum(map(len, prompts)),
            "without": without, "with": beside,
            "latency_ratio": beside["mean_request_latency_s"] / without["mean_request_latency_s"],
            "forward_latency_ratio": (beside["mean_forward_latency_s"]
                                      / without["mean_forward_latency_s"]),
            "throughput_ratio": beside["throughput_tok_s"] / without["throughput_tok_s"]}


def _median(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def format_report(report: dict) -> str:
    w, b = report["without"], report["with"]
    p = report["predictor"]
    return "\n".join([
        f"predictor: {p['kind']} G={p['granularity']} ({p['mode']}), "
        f"{report['num_prompt_tokens']} prompt tokens, median of {len(report['runs']['with'])} "
        f"alternating passes each",
        f"{'':22}{'without':>12}{'with':>12}{'ratio':>9}",
        f"{'request latency (s)':22}{w['mean_request_latency_s']:12.3f}"
        f"{b['mean_request_latency_s']:12.3f}{report['latency_ratio']:9.3f}",
        f"{'forward latency (s)':22}{w['mean_forward_latency_s']:12.4f}"
        f"{b['mean_forward_latency_s']:12.4f}{report['forward_latency_ratio']:9.3f}",
        f"{'throughput (tok/s)':22}{w['throughput_tok_s']:12.1f}{b['throughput_tok_s']:12.1f}"
        f"{report['throughput_ratio']:9.3f}"])
