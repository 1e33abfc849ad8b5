"""Where one engine forward spends its time: wall-clock timers around each op class (matmuls,
logits, attention and the attention kernel inside it, the fused elementwise kernels) of a
prefill of N tokens or a decode step at batch B, on the default model (or --model).

Each op is timed around its Python call, so the sum of the parts is a little under the whole
`execute`; the rest is building the batch, the embedding, sampling and Python between ops.
"linear" is every PackedLinear, the logits matmul included (also shown alone as "logits");
"attention kernel" is the part of "attention" spent in the C++ kernel.

    python -m bench.forward_breakdown --prefill 128 [--prefill 512] [--decode 32 --context 256]
"""

from __future__ import annotations

import argparse
import collections
import time
from contextlib import contextmanager

ROWS = ("execute", "linear", "logits", "attention", "attention kernel", "add_rms_norm",
        "rotary", "silu_and_mul")


@contextmanager
def _timers(runner, totals: collections.Counter):
    """Wraps the op entry points of this runner's model in timers; undone on exit."""
    from common.engine.attention import TorchAttention
    from common.engine.models.layers import PackedLinear

    ops = runner.model.ops
    targets = [(PackedLinear, "forward", "linear"), (TorchAttention, "__call__", "attention"),
               (type(runner.model), "compute_logits", "logits"),
               (type(runner), "execute", "execute")]
    targets += [(ops, name, name) for name in ("add_rms_norm", "rotary", "silu_and_mul")]
    for name in ("paged_decode_attention", "paged_prefill_attention", "paged_attention"):
        if hasattr(ops, name):
            targets.append((ops, name, "attention kernel"))
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in targets]
    for owner, name, key in targets:
        setattr(owner, name, _timed(getattr(owner, name), key, totals))
    try:
        yield
    finally:
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _timed(fn, key: str, totals: collections.Counter):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start
    return wrapper


def _report(title: str, totals: collections.Counter, repeats: int) -> None:
    print(f"\n{title}\n| part | ms per forward |\n|---|---|")
    for key in ROWS:
        if key in totals:
            print(f"| {key} | {totals[key] / repeats * 1e3:.1f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", type=int, action="append", default=[],
                        help="tokens of a fresh prefill (repeatable)")
    parser.add_argument("--decode", type=int, action="append", default=[],
                        help="decode batch size (repeatable)")
    parser.add_argument("--context", type=int, default=256, help="decode context tokens")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--model", default=None, help="weights path; default model when absent")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--cache-dir", default="~/.cache/splitserve")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    from common.config import EngineConfig, ModelConfig
    from common.engine.model_runner import ModelRunner
    from common.engine.profile import ProfileOptions, _Bench, _sized_for

    torch.set_num_threads(args.threads)
    config = EngineConfig(model=ModelConfig(path=args.model, dtype=args.dtype,
                                            cache_dir=args.cache_dir))
    runner = ModelRunner(_sized_for(config, ProfileOptions()))
    bench = _Bench(runner)
    cases = [(f"prefill {n} tokens", lambda n=n: bench.prefill_plan(n)) for n in args.prefill]
    cases += [(f"decode batch {b} x {args.context} tokens",
               lambda b=b: bench.decode_plan(b, args.context)) for b in args.decode]
    for title, make_plan in cases:
        plan, release = make_plan()
        try:
            runner.execute(plan)  # warm-up
            totals: collections.Counter = collections.Counter()
            with _timers(runner, totals):
                for _ in range(args.repeats):
                    runner.execute(plan)
            _report(title, totals, args.repeats)
        finally:
            release()
    runner.close()


if __name__ == "__main__":
    main()
