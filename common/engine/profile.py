"""`splitserve profile`: measure the engine against this machine's own limits, in one run.

- Prefill throughput against tokens per forward (1..2048). The saturation knee, the smallest
  size from which throughput stays within 90% of the best up to the best size, is the
  recommended ChunkSize.
- Decode throughput against batch size (1..128), every sequence holding `decode_context` tokens,
  greedy and sampled (temperature 0.7, top_p 0.95: what most traffic asks for), each step
  against its floor: every weight read once at the measured bandwidth plus its FLOPs at the
  measured matmul rate.
- Mixed forwards: a fresh prompt of 256 and of 1,024 tokens beside one and beside 16 decodes
  (what a co-located instance runs); the simulator's cost model is fitted to them too.
- Decode steps at other contexts and forwards of several fresh prompts
  (`common.engine.profile_shapes`): shapes only the simulator's cost model reads.
- The machine: bfloat16 matmul rate (a large square matmul) and memory read bandwidth.
- Ratios: prefill model FLOP/s at ChunkSize over the matmul rate; decode step time at batch 1 over
  the time to read every weight once at the measured bandwidth; optionally decode tokens/s against
  transformers `generate` (same weights, dtype and threads).

Writes profile.json and profile.png under the output directory, and records the ChunkSize and
the prefill and decode curves in the cache directory (common.profile_record: the last record,
and one per model, dtype and thread count), where the prefill instance (ChunkSize), the
co-located policies (common.schedulers.costs) and the gateway (local prefill budget) read the
one measured for their forwards. `measure_costs` is the short version a co-located instance
runs at start-up when no record fits its model.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from common.block_pool import KVCacheManager
from common.config import ConfigError, EngineConfig
from common.engine import cpu_features
from common.engine import profile_shapes
from common.engine.model_runner import ModelRunner
from common.engine.profile_report import print_summary, write_report
from common.plan import BatchPlan, ScheduledChunk
from common.sampling_params import SamplingParams
from common.profile_record import ProfileIdentity, read_record, write_record
from common.schedulers.costs import IterationCosts

PREFILL_SIZES = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
DECODE_BATCHES = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128]
# Mixed forwards, a fresh prompt beside running decodes (what a co-located instance runs): short
# and long prompts, each beside one and beside 16 decodes at the decode context. The short ones
# are what co-located instances mostly run at light load: with the long ones alone, the fit's
# per-mixed-forward constant came out at 43 ms where forwards of 1-32 tokens measured about 0
# (docs/simulator.md, forward log).
MIXED_PREFILL_SIZES = [16, 64, 256, 1024]
MIXED_DECODE_BATCHES = [1, 16]
KNEE_FRACTION = 0.9
GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=1 << 20, temperature=0.7, top_p=0.95)


@dataclass(frozen=True)
class ProfileOptions:
    max_prefill_tokens: int = 2048
    max_decode_batch: int = 128
    decode_context: int = 256
    out_dir: str = "results/profile"
    compare_hf: bool = False
    repeats: int = 3


# A shape is timed at least `repeats` times and until its samples add up to MIN_MEASURED_S:
# the median of 3 decode steps of 13 ms swung 10% between neighbouring batch sizes on a quiet
# Zen 4 (batch 2 timed slower than batch 4), and the low-rate loads the simulator is checked
# against run mostly such small forwards. Long forwards stay at `repeats`.
MIN_MEASURED_S = 0.3
MAX_SAMPLES = 100


def _timed(fn, repeats: int) -> float:
    """Median seconds of at least `repeats` calls (more for short calls: MIN_MEASURED_S),
    after one warm-up call."""
    fn()
    samples: list[float] = []
    while len(samples) < repeats or (sum(samples) < MIN_MEASURED_S
                                     and len(samples) < MAX_SAMPLES):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def machine_limits(dtype: torch.dtype, repeats: int = 5) -> dict:
    """The best this machine does at matmul (2048^3 in `dtype`) and at reading memory (512 MiB).

    Each is the fastest of several ways torch offers (plain mm and oneDNN's packed matmul;
    reductions and copies of several dtypes), so the ratios against them are not flattered.
    """
    from common.engine.models.layers import PackedLinear, can_pack

    a = torch.randn(2048, 2048, dtype=dtype)
    b = torch.randn(2048, 2048, dtype=dtype)
    matmul_s = _timed(lambda: torch.mm(a, b), repeats)
    if can_pack(dtype, torch.device("cpu")):
        packed = PackedLinear(b, None)
        matmul_s = min(matmul_s, _timed(lambda: packed(a), repeats))
    nbytes = 512 * 2**20
    read_s = []
    for kind in (torch.float32, torch.float16, torch.bfloat16):
        buffer = torch.ones(nbytes // torch.finfo(kind).bits * 8, dtype=kind)
        read_s += [_timed(lambda: buffer.sum(), repeats), _timed(lambda: buffer.max(), repeats)]
    vector = torch.ones(nbytes // 4)
    read_s.append(_timed(lambda: torch.dot(vector, vector), repeats))
    target = torch.empty_like(vector)
    copy_s = _timed(lambda: target.copy_(vector), repeats)
    return {"matmul_flops": 2 * 2048**3 / matmul_s, "read_bytes_per_s": nbytes / min(read_s),
            "copy_bytes_per_s": 2 * nbytes / copy_s}


class _Bench:
    """Hand-built plans on a runner: fresh prefills of N tokens, decode steps at batch B, and
    the two in one forward."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        layout = runner.kv_layout
        self.kv = KVCacheManager(layout.num_blocks, layout.block_size)
        self.vocab = runner.model.shape.vocab_size
        self.counter = 0

    def _tokens(self, n: int) -> list[int]:
        return torch.randint(100, self.vocab - 100, (n,)).tolist()

    def prefill_plan(self, num_tokens: int):
        """(plan of a fresh prefill of num_tokens, function freeing its blocks)."""
        seq_id = f"prefill-{self.counter}"
        self.counter += 1
        blocks = self.kv.grow(seq_id, num_tokens)
        if blocks is None:
            raise ConfigError(f"KV pool too small for a {num_tokens}-token prompt beside what "
                              "the profile holds: raise --num-blocks or leave it unset")
        plan = BatchPlan([ScheduledChunk(seq_id, self._tokens(num_tokens), 0, blocks, GREEDY)])
        return plan, lambda: self.kv.free(seq_id)

    def decode_plan(self, batch: int, context: int):
        """(plan of one decode step of `batch` sequences with `context` tokens each in the
        cache, function freeing their blocks)."""
        seq_ids = [f"decode-{self.counter}-{i}" for i in range(batch)]
        self.counter += 1
        tables = [self.kv.grow(s, context + 1) for s in seq_ids]

        def release():
            for seq_id in seq_ids:
                self.kv.free(seq_id)
        try:
            if any(t is None for t in tables):
                raise ConfigError(f"KV pool too small for decode batch {batch} x {context} "
                                  "tokens: raise --num-blocks or leave it unset")
            for seq_id, table in zip(seq_ids, tables):  # fill the context once
                self.runner.execute(BatchPlan([ScheduledChunk(seq_id, self._tokens(context), 0,
                                                              table)]))
        except BaseException:
            release()
            raise
        plan = BatchPlan([ScheduledChunk(s, self._tokens(1), context, t, GREEDY, 1)
                          for s, t in zip(seq_ids, tables)])
        return plan, release

    def prefill_seconds(self, num_tokens: int, repeats: int) -> float:
        plan, release = self.prefill_plan(num_tokens)
        try:
            return _timed(lambda: self.runner.execute(plan), repeats)
        finally:
            release()

    def mixed_seconds(self, num_tokens: list[int], batch: int, context: int, repeats: int
                      ) -> list[float]:
        """Seconds of a forward of one fresh prompt of each of `num_tokens` beside one decode
        step of `batch` sequences (filled once, reused for every prompt size)."""
        decode, release = self.decode_plan(batch, context)
        try:
            seconds = []
            for n in num_tokens:
                prefill, free = self.prefill_plan(n)
                plan = BatchPlan(prefill.chunks + decode.chunks)
                try:
                    seconds.append(_timed(lambda: self.runner.execute(plan), repeats))
                finally:
                    free()
            return seconds
        finally:
            release()

    def multi_prompt_seconds(self, num_prompts: int, num_tokens: int, repeats: int) -> float:
        """Seconds of one forward of `num_prompts` fresh prompts of `num_tokens` each."""
        plans = [self.prefill_plan(num_tokens) for _ in range(num_prompts)]
        plan = BatchPlan([chunk for p, _ in plans for chunk in p.chunks])
        try:
            return _timed(lambda: self.runner.execute(plan), repeats)
        finally:
            for _, free in plans:
                free()

    def decode_seconds(self, batch: int, context: int, repeats: int) -> tuple[float, float]:
        """(greedy, sampled) seconds per decode step, on the same sequences."""
        plan, release = self.decode_plan(batch, context)
        sampled = BatchPlan([replace(c, sampling=SAMPLED) for c in plan.chunks])
        try:
            return (_timed(lambda: self.runner.execute(plan), repeats),
                    _timed(lambda: self.runner.execute(sampled), repeats))
        finally:
            release()


def knee(sizes: list[int], throughputs: list[float]) -> int:
    """The smallest size from which throughput stays within KNEE_FRACTION of the best up to
    the best size: one noisy fast point below the saturation (a shared machine gives those)
    does not count as the knee."""
    best_at = max(range(len(sizes)), key=throughputs.__getitem__)
    floor = KNEE_FRACTION * throughputs[best_at]
    start = best_at
    while start > 0 and throughputs[start - 1] >= floor:
        start -= 1
    return sizes[start]


def profile_prefill(bench: _Bench, sizes: list[int], repeats: int, progress) -> list[dict]:
    rows = []
    for n in sizes:
        seconds = bench.prefill_seconds(n, repeats)
        rows.append({"tokens": n, "seconds": seconds, "tokens_per_s": n / seconds})
        progress(f"prefill {n:5d} tokens: {n / seconds:9.1f} tok/s")
    return rows


def profile_decode(bench: _Bench, batches: list[int], context: int, repeats: int,
                   limits: dict, progress) -> list[dict]:
    rows = []
    for b in batches:
        seconds, sampled = bench.decode_seconds(b, context, repeats)
        floor = decode_floor_seconds(bench.runner, limits, b, context)
        rows.append({"batch": b, "step_seconds": seconds, "tokens_per_s": b / seconds,
                     "sampled_step_seconds": sampled, "sampled_over_greedy": sampled / seconds,
                     "floor_seconds": floor, "step_over_floor": seconds / floor})
        progress(f"decode batch {b:4d}: {b / seconds:9.1f} tok/s ({seconds * 1e3:.1f} ms/step, "
                 f"{seconds / floor:.2f}x floor); sampled {sampled * 1e3:.1f} ms/step "
                 f"({sampled / seconds:.2f}x greedy)")
    return rows


def profile_mixed(bench: _Bench, sizes: list[int], batches: list[int], context: int,
                  repeats: int, progress) -> list[dict]:
    rows = []
    for b in batches:
        for n, seconds in zip(sizes, bench.mixed_seconds(sizes, b, context, repeats)):
            rows.append({"prefill_tokens": n, "batch": b, "context": context,
                         "seconds": seconds})
            progress(f"mixed {n:5d}-token prompt + {b:3d} decodes: {seconds * 1e3:.1f} ms")
    return rows


def mixed_shapes(options: ProfileOptions) -> tuple[list[int], list[int]]:
    """The mixed rows' prompt sizes and decode batches within the profile's limits (half the
    largest prompt when both default sizes are over it)."""
    sizes = [n for n in MIXED_PREFILL_SIZES if n <= options.max_prefill_tokens]
    batches = [b for b in MIXED_DECODE_BATCHES if b <= options.max_decode_batch]
    return sizes or [max(options.max_prefill_tokens // 2, 1)], batches


def decode_floor_seconds(runner: ModelRunner, limits: dict, batch: int, context: int) -> float:
    """What a decode step needs at least: every weight read once at the measured bandwidth plus
    the step's FLOPs (matmuls, attention over `context`, logits) at the measured matmul rate.
    The KV cache's own read is not in it (as in the issue's definition)."""
    shape = runner.model.shape
    flops = batch * (shape.flops_per_token(runner.model.num_matmul_params(), context)
                     + 2 * shape.vocab_size * shape.hidden_size)
    return runner.weight_bytes / limits["read_bytes_per_s"] + flops / limits["matmul_flops"]


def prefill_flops_per_token(runner: ModelRunner, num_tokens: int) -> float:
    model = runner.model
    shape = model.shape
    per_token = shape.flops_per_token(model.num_matmul_params(), (num_tokens + 1) / 2)
    logits = 2 * shape.vocab_size * shape.hidden_size / num_tokens  # one sampled row per chunk
    return per_token + logits


def run_profile(config: EngineConfig, options: ProfileOptions) -> dict:
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)
    runner = ModelRunner(_sized_for(config, options))
    bench = _Bench(runner)
    limits = machine_limits(runner.model.embed_tokens.weight.dtype)
    cpu = cpu_features.describe()
    progress(f"machine: {cpu}; "
             f"{limits['matmul_flops'] / 1e9:.0f} GFLOP/s {runner.dtype_name} matmul, "
             f"{limits['read_bytes_per_s'] / 1e9:.1f} GB/s read")
    sizes = [n for n in PREFILL_SIZES if n <= options.max_prefill_tokens]
    prefill = profile_prefill(bench, sizes, options.repeats, progress)
    batches = [b for b in DECODE_BATCHES if b <= options.max_decode_batch]
    decode = profile_decode(bench, batches, options.decode_context, options.repeats, limits,
                            progress)
    mixed = profile_mixed(bench, *mixed_shapes(options), options.decode_context,
                          options.repeats, progress)
    contexts = profile_shapes.profile_contexts(bench, options.max_decode_batch,
                                               runner.max_model_len, options.repeats, progress)
    multi = profile_shapes.profile_multi_prompt(bench, options.max_prefill_tokens,
                                                options.repeats, progress)
    chunk_size = knee(sizes, [r["tokens_per_s"] for r in prefill])
    report = {
        "model": runner.resolved.name, "dtype": runner.dtype_name,
        "threads": torch.get_num_threads(), "cpu": cpu, "machine": limits,
        "prefill": prefill, "decode": decode, "mixed": mixed, "decode_contexts": contexts,
        "multi_prompt": multi,
        "decode_context": options.decode_context,
        "recommended_chunk_size": chunk_size,
        "ratios": _ratios(runner, limits, prefill, decode, chunk_size),
        "options": asdict(options), "min_measured_s": MIN_MEASURED_S,
    }
    if options.compare_hf:
        from common.engine.hf_baseline import compare_decode

        report["hf_decode"] = compare_decode(runner, decode, options.decode_context, progress)
    write_report(report, Path(options.out_dir))
    _record(report, config.model.cache_dir)
    print_summary(report)
    runner.close()
    return report


def _sized_for(config: EngineConfig, options: ProfileOptions) -> EngineConfig:
    """Without --num-blocks, a KV pool holding the largest decode batch and the largest prompt
    at once (the mixed rows), in any dtype (a fixed memory budget held half as many float32
    tokens as bfloat16 ones)."""
    if config.cache.num_blocks is not None:
        return config
    block = config.cache.block_size
    per_sequence = -(-(options.decode_context + 1) // block)
    needed = options.max_decode_batch * per_sequence + -(-options.max_prefill_tokens // block)
    shapes = profile_shapes.pool_tokens(options.max_decode_batch, config.model.max_model_len
                                        or 8192, options.max_prefill_tokens, block) // block
    needed = max(needed, shapes)
    return replace(config, cache=replace(config.cache, num_blocks=needed + 1))


def _ratios(runner, limits, prefill, decode, chunk_size) -> dict:
    at_chunk = next(r for r in prefill if r["tokens"] == chunk_size)
    model_flops = at_chunk["tokens_per_s"] * prefill_flops_per_token(runner, chunk_size)
    ratios = {"prefill_flops_at_chunk_size": model_flops,
              "prefill_fraction_of_matmul_rate": model_flops / limits["matmul_flops"]}
    batch1 = next((r for r in decode if r["batch"] == 1), None)
    if batch1:
        stream_s = runner.weight_bytes / limits["read_bytes_per_s"]
        ratios.update(weight_bytes=runner.weight_bytes, weight_stream_seconds=stream_s,
                      decode_batch1_over_weight_stream=batch1["step_seconds"] / stream_s)
    return ratios




def recorded_chunk_size(cache_dir: str, identity: ProfileIdentity = ProfileIdentity()
                        ) -> int | None:
    """The ChunkSize `splitserve profile` recommended on this machine for forwards of
    `identity` (its model, dtype and threads), if it recorded one."""
    record = read_record(cache_dir, identity)
    try:
        return int(record["recommended_chunk_size"]) if record is not None else None
    except (KeyError, TypeError, ValueError):
        return None


def _record(report: dict, cache_dir: str) -> None:
    """What later starts read: the ChunkSize, and the curves behind the co-located policies'
    cost model (common.schedulers.costs: FastServe's job profiler, the TBT token budget)."""
    keys = ("recommended_chunk_size", "model", "dtype", "threads", "decode_context")
    record = {key: report[key] for key in keys}
    record["prefill"] = [{"tokens": r["tokens"], "seconds": r["seconds"]}
                         for r in report["prefill"]]
    record["decode"] = [{"batch": r["batch"], "step_seconds": r["step_seconds"]}
                        for r in report["decode"]]
    for key in ("mixed", "decode_contexts", "multi_prompt"):  # what simulator/fit.py reads
        record[key] = report.get(key, [])
    write_record(cache_dir, record)


# A start-up measurement is a few seconds on two cores: few sizes, one timed run each, short
# decode contexts (filling 32 sequences x 256 tokens would take longer than the rest).
STARTUP_PREFILL_SIZES = [1, 16, 64, 256, 1024]
STARTUP_DECODE_BATCHES = [1, 8, 32]
STARTUP_DECODE_CONTEXT = 32


def measure_costs(runner: ModelRunner, repeats: int = 1) -> IterationCosts:
    """A short profile on the runner's own KV blocks, taken before it serves (the blocks hold
    nothing yet): prefill forwards and greedy decode steps at a few sizes that fit the pool."""
    bench = _Bench(runner)
    capacity = bench.kv.num_blocks * bench.kv.block_size
    sizes = [n for n in STARTUP_PREFILL_SIZES if n <= min(capacity, runner.max_model_len)]
    prefill = [(n, bench.prefill_seconds(n, repeats)) for n in sizes]
    decode = []
    for batch in STARTUP_DECODE_BATCHES:
        if bench.kv.num_blocks_for(STARTUP_DECODE_CONTEXT + 1) * batch > bench.kv.num_blocks:
            break
        plan, release = bench.decode_plan(batch, STARTUP_DECODE_CONTEXT)
        try:
            decode.append((batch, _timed(lambda: runner.execute(plan), repeats)))
        finally:
            release()
    return IterationCosts(tuple(prefill), tuple(decode), source="measured at start-up")
