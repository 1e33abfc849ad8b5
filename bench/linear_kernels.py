"""Linear layers on the CPU: `F.linear`, oneDNN's packed weight and the skinny kernel (float32
on AVX2, bfloat16 on AVX512-BF16), on the default model's matmul shapes (hidden 576,
intermediate 1536), per decode-sized row count. The time of one pass over all of a layer's
weights (qkv, o, gate_up, down), times 30 layers; the weights of 30 distinct layers stream from
DRAM as in a real step.

    python -m bench.linear_kernels [--threads 2] [--dtype float32|bfloat16|auto] [--rows 1,8,256]
"""

from __future__ import annotations

import argparse

from bench.attention_kernels import mean_ms

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out) per layer
LAYERS = 30
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)),
                        help="comma-separated row counts")
    parser.add_argument("--cache-dir", default="~/.cache/splitserve")
    parser.add_argument("--dtype", default="auto", choices=["float32", "bfloat16", "auto"],
                        help="auto = what the engine's --dtype auto runs on this CPU")
    args = parser.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from common.engine import cpu_kernels
    from common.engine.cpu_features import default_cpu_dtype
    from common.engine.models.layers import PackedLinear

    torch.set_num_threads(args.threads)
    dtype_name = default_cpu_dtype() if args.dtype == "auto" else args.dtype
    dtype = getattr(torch, dtype_name)
    kernels = cpu_kernels.load(args.cache_dir)
    if kernels is None or dtype_name not in kernels.skinny_linear_dtypes():
        raise SystemExit(f"no skinny {dtype_name} kernel on this CPU/build: nothing to compare")
    print(f"dtype: {dtype_name}")
    weights = [[torch.randn(n, k).to(dtype) for k, n in SHAPES] for _ in range(LAYERS)]
    packed = [[PackedLinear(w, None) for w in layer] for layer in weights]
    skinny = [[PackedLinear(w, None, kernels) for w in layer] for layer in weights]
    print(f"| rows | F.linear (ms, {LAYERS} layers) | oneDNN packed | skinny | "
          "skinny vs oneDNN |\n|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k).to(dtype) for k, _ in SHAPES}

        def run(layers, call):
            for layer in layers:
                for (k, _), op in zip(SHAPES, layer):
                    call(op, inputs[k])

        plain = mean_ms(lambda: run(weights, lambda w, x: F.linear(x, w)))
        onednn = mean_ms(lambda: run(packed, lambda op, x: op(x)))
        fast = mean_ms(lambda: run(skinny, lambda op, x: op.skinny_forward(x)))
        print(f"| {rows} | {plain:.1f} | {onednn:.1f} | {fast:.1f} | {onednn / fast:.2f}x |")


if __name__ == "__main__":
    main()
