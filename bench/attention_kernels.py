"""Attention on the CPU: torch's SDPA against the engine's paged kernel, on the shapes of the
default model (9 query and 3 KV heads of 64 dims; bfloat16, or what `--dtype auto` means on this
CPU), per forward of 30 layers.

Cases: decode batches (one query per sequence over its context) and prefill chunks (a chunk of
n rows over `cached` earlier tokens, causal), the latter also through the decode kernel with one
query row per task (how prefill chunks ran before the tiled prefill kernel). Each time is the mean of several calls after a
warm-up; the KV of the decode case spans 30 layers' worth of distinct memory so it streams from
DRAM as in a real step. Prints a table and the speedup of the kernel.

    python -m bench.attention_kernels [--threads 2] [--dtype bfloat16|float32|auto]
"""

from __future__ import annotations

import argparse
import time

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
PREFILL_CASES = ((128, 0), (128, 512), (128, 1920), (512, 0), (1024, 0))  # (rows, cached tokens)
DECODE_CASES = ((32, 256), (8, 1024), (128, 512))  # (batch, context)


def mean_ms(fn, repeats: int = 10) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def _cache(num_blocks: int, dtype):
    import torch

    keys = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    return keys, torch.randn_like(keys)


def prefill_case(ops, rows: int, cached: int, dtype) -> tuple[float, float, float]:
    """(SDPA, row-per-task decode kernel, prefill kernel) ms for one chunk, times 30 layers."""
    import torch
    import torch.nn.functional as F

    context = cached + rows
    num_blocks = -(-context // BLOCK)
    k_cache, v_cache = _cache(num_blocks, dtype)
    q = torch.randn(rows, HEADS, HEAD_DIM).to(dtype)
    keys = k_cache.view(-1, KV_HEADS, HEAD_DIM)[:context].transpose(0, 1).unsqueeze(0)
    values = v_cache.view(-1, KV_HEADS, HEAD_DIM)[:context].transpose(0, 1).unsqueeze(0)
    mask = torch.arange(context)[None, :] <= torch.arange(cached, context)[:, None]
    query = q.transpose(0, 1).unsqueeze(0)
    table = torch.arange(num_blocks)
    lengths = torch.arange(cached + 1, context + 1)
    out = torch.empty_like(q)

    def sdpa():
        F.scaled_dot_product_attention(query, keys, values, attn_mask=mask if cached else None,
                                       is_causal=not cached, enable_gqa=True)

    def per_row():
        ops.paged_decode_attention(q, k_cache, v_cache, table.expand(rows, -1), lengths, None)

    def tiled():
        ops.paged_prefill_attention(out, q, k_cache, v_cache, table, cached, None)

    return LAYERS * mean_ms(sdpa), LAYERS * mean_ms(per_row), LAYERS * mean_ms(tiled)


def decode_case(ops, batch: int, context: int, dtype) -> tuple[float, float]:
    """(SDPA ms, kernel ms) for one decode step over 30 layers of distinct KV."""
    import torch
    import torch.nn.functional as F

    per_seq = -(-context // BLOCK)
    layers = [_cache(batch * per_seq, dtype) for _ in range(LAYERS)]
    table = torch.arange(batch * per_seq).view(batch, per_seq)
    lengths = torch.full((batch,), context)
    q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
    grouped = q.view(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)

    def sdpa():
        for k_cache, v_cache in layers:  # contiguous per sequence: no gather (favours SDPA)
            keys = k_cache.view(batch, -1, KV_HEADS, HEAD_DIM).transpose(1, 2)
            values = v_cache.view(batch, -1, KV_HEADS, HEAD_DIM).transpose(1, 2)
            F.scaled_dot_product_attention(grouped, keys, values)

    def kernel():
        for k_cache, v_cache in layers:
            ops.paged_decode_attention(q, k_cache, v_cache, table, lengths, None)

    return mean_ms(sdpa), mean_ms(kernel)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", default="~/.cache/splitserve")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "auto"],
                        help="auto = what the engine's --dtype auto runs on this CPU")
    args = parser.parse_args(argv)
    import torch

    from common.engine.cpu_features import default_cpu_dtype
    from common.engine.ops import make_ops

    torch.set_num_threads(args.threads)
    dtype_name = default_cpu_dtype() if args.dtype == "auto" else args.dtype
    print(f"dtype: {dtype_name}")
    dtype = getattr(torch, dtype_name)
    ops = make_ops(dtype, torch.device("cpu"), args.cache_dir)
    if not hasattr(ops, "paged_decode_attention"):
        raise SystemExit("the CPU kernels did not build here: nothing to compare")
    print("| prefill case | SDPA (ms, 30 layers) | decode kernel, row per task (ms) | "
          "prefill kernel (ms) | prefill kernel vs SDPA |\n|---|---|---|---|---|")
    for rows, cached in PREFILL_CASES:
        sdpa, per_row, tiled = prefill_case(ops, rows, cached, dtype)
        print(f"| {rows} rows over {cached} cached | {sdpa:.1f} | {per_row:.1f} | {tiled:.1f} | "
              f"{sdpa / tiled:.2f}x |")
    print("\n| decode case | SDPA (ms, 30 layers) | paged kernel (ms) | speedup |\n|---|---|---|---|")
    for batch, context in DECODE_CASES:
        sdpa, kernel = decode_case(ops, batch, context, dtype)
        print(f"| decode batch {batch} x {context} tokens | {sdpa:.1f} | {kernel:.1f} | "
              f"{sdpa / kernel:.2f}x |")


if __name__ == "__main__":
    main()
