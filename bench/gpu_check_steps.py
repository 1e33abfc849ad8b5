"""The measurements behind scripts/gpu_check.py, one function per step, each returning a
JSON-ready dict. All of them need a CUDA GPU (the script checks for one before calling any).

Models are random-weight checkpoints built here (no weights travel to a GPU host): speed does not
depend on the weights' values, and equality checks compare two paths on the same weights.
Timings synchronize the GPU and take the median of several runs after a warm-up.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from common.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from common.plan import BatchPlan
from common.sampling_params import SamplingParams

# SmolLM2-135M (the default model) and Llama-3.2-1B shapes
SMOL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
            tie_word_embeddings=True)
ONE_B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
             rope_theta=500000.0, tie_word_embeddings=True)
SAMPLED = SamplingParams(max_tokens=1 << 20, temperature=0.7, top_p=0.95)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")
# The two layouts of a served run: `splitserve up` flags besides the model's
LAYOUTS = {"disaggregated": ["--prefill", "1", "--decode", "1", "--transfer", "cuda_ipc"],
           "co-located": ["--prefill", "0", "--decode", "0", "--coupled", "1",
                          "--policy", "sarathi"]}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_model(dst: Path, tokenizer_dir: Path, shape: dict, dtype: torch.dtype) -> Path:
    """A random-weight Llama checkpoint of `shape` in `dst`, with the given tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (dst / "config.json").exists():
        return dst  # built by an earlier run into the same work folder
    config = LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
                         **shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    model.to(dtype).save_pretrained(dst, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, dst / name)
    del model
    torch.cuda.empty_cache()
    return dst


def gpu_tests(repo: Path) -> dict:
    """`pytest tests/gpu -m gpu` in its own process (compiled kernels: no interpreter flag)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q",
                           "-p", "no:cacheprovider"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {"returncode": done.returncode, "summary": lines[-1] if lines else "",
            "seconds": time.perf_counter() - started, "output_tail": done.stdout[-4000:]}


def engine_config(model_dir: Path, device: str, dtype: str, cuda_graphs: bool = True,
                  num_blocks: int = 512, max_seqs: int = 256) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=str(model_dir), device=device, dtype=dtype,
                          cuda_graphs=cuda_graphs, cuda_graph_max_batch=max_seqs),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        batch=BatchConfig(max_num_seqs=max_seqs, max_num_batched_tokens=8192))


def engine_greedy(model_dir: Path, device: str, dtype: str, prompts: list[list[int]],
                  max_tokens: int = 24) -> list[list[int]]:
    from common.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(model_dir, device, dtype, max_seqs=8))
    try:
        params = engine.default_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [r.token_ids for r in engine.generate(prompts, [params] * len(prompts))]
    finally:
        engine.close()


def parity(model_dir: Path) -> dict:
    """Greedy tokens of the CUDA engine (its default backend: Triton kernel, graphs) against the
    CPU engine, float32; and how many bfloat16 CUDA tokens agree with them."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40000, (n,), generator=gen).tolist() for n in (3, 70, 300)]
    cpu = engine_greedy(model_dir, "cpu", "float32", prompts)
    cuda = engine_greedy(model_dir, "cuda", "float32", prompts)
    bf16 = engine_greedy(model_dir, "cuda", "bfloat16", prompts)
    agree = lambda xs: sum(a == b for x, y in zip(xs, cpu) for a, b in zip(x, y))  # noqa: E731
    return {"float32_equal": cuda == cpu, "float32_tokens_equal": agree(cuda),
            "bfloat16_tokens_equal": agree(bf16), "tokens": sum(map(len, cpu))}


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` synchronized calls after one warm-up call."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def read_bandwidth() -> float:
    """Bytes/s of the device's memory, reading 2 GiB (a sum)."""
    buffer = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")
    seconds = timed(lambda: buffer.sum(), 5)
    nbytes = buffer.numel() * buffer.element_size()
    del buffer
    torch.cuda.empty_cache()
    return nbytes / seconds


def prefill_rows(bench, sizes: list[int], repeats: int = 3) -> list[dict]:
    rows = []
    for n in sizes:
        plan, release = bench.prefill_plan(n)
        try:
            seconds = timed(lambda: bench.runner.execute(plan), repeats)
        finally:
            release()
        rows.append({"tokens": n, "seconds": seconds, "tokens_per_s": n / seconds})
        log(f"prefill {n:5d} tokens: {n / seconds:10.0f} tok/s")
    return rows


def decode_rows(bench, batches: list[int], context: int, repeats: int = 5) -> list[dict]:
    """Step time at each batch, greedy and sampled, every sequence over `context` tokens."""
    rows = []
    for batch in batches:
        plan, release = bench.decode_plan(batch, context)
        sampled = BatchPlan([replace(c, sampling=SAMPLED) for c in plan.chunks])
        try:
            greedy_s = timed(lambda: bench.runner.execute(plan), repeats)
            sampled_s = timed(lambda: bench.runner.execute(sampled), repeats)
        finally:
            release()
        rows.append({"batch": batch, "step_ms": greedy_s * 1e3, "tokens_per_s": batch / greedy_s,
                     "sampled_step_ms": sampled_s * 1e3})
        log(f"decode batch {batch:4d}: {greedy_s * 1e3:7.2f} ms/step greedy, "
            f"{sampled_s * 1e3:7.2f} sampled")
    return rows


def engine_perf(model_dir: Path, dtype: str, prefills: list[int], batches: list[int],
                context: int, device: str = "cuda") -> dict:
    """Prefill throughput (graphs do not touch prefill) and decode steps with CUDA graphs on and
    off, through the runner alone."""
    from common.engine.model_runner import ModelRunner
    from common.engine.profile import _Bench

    blocks = max(batches) * -(-(context + 1) // 16) + max(prefills) // 16 + 16
    report = {"dtype": dtype, "decode_context": context}
    for graphs in (True, False):
        runner = ModelRunner(engine_config(model_dir, device, dtype, graphs, blocks, max(batches)))
        try:
            bench = _Bench(runner)
            key = "graphs_on" if graphs else "graphs_off"
            report.update(weight_bytes=runner.weight_bytes,
                          attention=runner.attention_cls.__name__)
            report[f"decode_{key}"] = decode_rows(bench, batches, context)
            report[f"buckets_{key}"] = runner.graphs.buckets if runner.graphs else []
            if graphs:
                report["prefill"] = prefill_rows(bench, prefills)
        finally:
            runner.close()
            if device == "cuda":
                torch.cuda.empty_cache()
    return report


def hf_perf(model_dir: Path, dtype: torch.dtype, batches: list[int], context: int,
            new_tokens: int = 32) -> list[dict]:
    """transformers `generate` step time: generate(1 + N) minus generate(1), over N."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
    rows = []
    for batch in batches:
        ids = torch.randint(100, 49000, (batch, context), device="cuda")

        def generate(n: int) -> None:
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)
        step = (timed(lambda: generate(new_tokens + 1), 2) - timed(lambda: generate(1), 2))
        step /= new_tokens
        rows.append({"batch": batch, "step_ms": step * 1e3, "tokens_per_s": batch / step})
        log(f"transformers generate batch {batch}: {step * 1e3:.2f} ms/step")
    del model
    torch.cuda.empty_cache()
    return rows


def bench_requests(model_dir: Path, count: int, prompt_words: int, max_tokens: int):
    from bench.workload import BenchRequest
    from common.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(model_dir)
    prompts = [f"Request {i}: " + "lorem ipsum " * prompt_words for i in range(count)]
    return [BenchRequest(p, len(tokenizer.encode(p)), max_tokens, max_tokens) for p in prompts]


def served(model_dir: Path, dtype: str, layout: str, streams: int, rounds: int,
           prompt_words: int, max_tokens: int, work: Path, device: str = "cuda") -> dict:
    """`splitserve up` in `layout` under `rounds` waves of `streams` concurrent streams."""
    from bench.client import run_load
    from bench.cluster import ClusterProcess
    from bench.metrics import summarize

    args = ["--model", str(model_dir), "--device", device, "--dtype", dtype,
            "--kv-memory-gib", "8", "--max-num-seqs", str(max(streams, 128)), *LAYOUTS[layout]]
    requests = bench_requests(model_dir, streams, prompt_words, max_tokens)
    with ClusterProcess(args, work / f"served-{layout}.log", startup_timeout_s=600) as cluster:
        model = cluster.model()
        load = lambda reqs: asyncio.run(run_load(  # noqa: E731
            cluster.url, model, reqs, [0.0] * len(reqs), ignore_eos=True, progress=False))
        load(requests[:2])  # warm-up: first forwards compile kernels, capture nothing new
        started, records = time.perf_counter(), []
        for _ in range(rounds):
            records += load(requests)
        duration = time.perf_counter() - started
    summary = summarize(records, duration)
    log(f"served {layout}: {summary['throughput']['output_tokens_per_s']} output tok/s")
    return {"layout": layout, "args": args, "streams": streams, "rounds": rounds,
            "prompt_tokens": statistics.mean(r.num_prompt_tokens for r in requests), **summary}
