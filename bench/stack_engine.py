"""The stack-ceiling model, and the engine alone that served runs are measured against.

Owns: building the random-weight model once into the cache, and timing the model runner by
itself (a decode step at the served batch, greedy and sampled, and a prefill forward of
ChunkSize tokens) in a child process that stays up for the whole benchmark (`EngineAlone`), so
each served run is compared with a measurement taken just before it: this VM's speed drifts by
10-15% between minutes, and the benchmark's client never loads torch.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from bench import cpu_share

MODEL_NAME = "stack-ceiling-llama-4l"
SHAPE = dict(vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
             rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


@dataclass(frozen=True)
class EngineSettings:
    cache_dir: str
    threads: int  # torch threads, as each served instance has
    batch: int  # the decode batch: the served concurrency
    context: int  # tokens in each sequence's cache
    chunk_size: int  # tokens of the timed prefill forward
    repeats: int  # each timing is the median of this many forwards
    max_others: float  # cores other processes may use while timing; above, timed again
    attempts: int
    quiet_timeout_s: float


def build_model(cache_dir: str) -> Path:
    """The random-weight model (seed 0, bfloat16, the default model's tokenizer files), saved
    once as CACHE/models/stack-ceiling-llama-4l."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.model_files import resolve_model

    cache = Path(cache_dir).expanduser()
    dst = cache / "models" / MODEL_NAME
    if (dst / "config.json").exists():
        return dst
    tokenizer_dir = resolve_model(None, cache, in_subprocess=True).hf_dir
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    tmp = dst.with_name(f"{MODEL_NAME}.tmp-{os.getpid()}")
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, tmp / name)
    try:
        tmp.rename(dst)
    except OSError:  # another run built it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


_BENCHES: dict = {}  # settings -> (model directory, profile._Bench), in the child process


def _bench(settings: EngineSettings):
    if settings not in _BENCHES:
        from common.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
        from common.engine.model_runner import ModelRunner
        from common.engine.profile import _Bench

        model_dir = build_model(settings.cache_dir)
        blocks = settings.batch * -(-(settings.context + 1) // 16) + settings.chunk_size // 16
        runner = ModelRunner(EngineConfig(
            model=ModelConfig(path=str(model_dir), cache_dir=settings.cache_dir,
                              num_threads=settings.threads),
            cache=CacheConfig(block_size=16, num_blocks=blocks + 16),
            batch=BatchConfig(max_num_seqs=settings.batch,
                              max_num_batched_tokens=settings.chunk_size)))
        _BENCHES[settings] = (model_dir, _Bench(runner))
    return _BENCHES[settings]


def measure(settings: EngineSettings) -> dict:
    """Decode steps at `batch` (greedy, sampled) and a ChunkSize prefill, timed on a quiet
    machine (again while other load disturbs them, up to `attempts` times)."""
    model_dir, bench = _bench(settings)
    me = {"engine": os.getpid()}
    for attempt in range(1, settings.attempts + 1):
        cpu_share.wait_for_quiet(me, settings.max_others, settings.quiet_timeout_s)
        before, started = cpu_share.reading(me), time.perf_counter()
        greedy_s, sampled_s = bench.decode_seconds(settings.batch, settings.context,
                                                   settings.repeats)
        prefill_s = bench.prefill_seconds(settings.chunk_size, settings.repeats)
        shares = cpu_share.cpu_shares(before, cpu_share.reading(me),
                                      time.perf_counter() - started)
        if (shares[cpu_share.OTHERS] or 0.0) <= settings.max_others:
            break
    return {"model_dir": str(model_dir), "threads": settings.threads, "batch": settings.batch,
            "context": settings.context, "dtype": bench.runner.dtype_name, "attempts": attempt,
            "cpu_share": shares, "greedy_step_s": greedy_s, "sampled_step_s": sampled_s,
            "greedy_tokens_per_s": settings.batch / greedy_s,
            "sampled_tokens_per_s": settings.batch / sampled_s,
            "prefill_tokens": settings.chunk_size,
            "prefill_tokens_per_s": settings.chunk_size / prefill_s}


class EngineAlone:
    """`measure()` in one child process kept up between calls (model loaded once)."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"))

    def measure(self) -> dict:
        return self.pool.submit(measure, self.settings).result()

    def close(self) -> None:
        self.pool.shutdown()

    def __enter__(self) -> EngineAlone:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
