"""Interference study (TetriInfer §2, Figs. 3-5; experiment E6): how much co-located requests
slow each other down in one forward, measured on the engine directly.

- prefill + prefill: a light prompt (LP, 18 tokens) alone vs batched with 7 and 63 other light
  prompts, and with one heavy prompt (HP: ChunkSize tokens, and 512);
- decode + prefill: a decode batch of light decodes alone vs with one heavy prompt in the same
  forward (the hybrid batch of a co-located scheduler);
- decode + decode: a batch of 32 decodes with short contexts (LD) vs half of them with long
  contexts (HD), per-token latency and throughput.

Each cell is the median of several forwards; reports ratios to the alone case. JSON + PNG.

    splitserve bench interference --out results/interference
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class InterferenceOptions:
    light_prompt: int = 18
    heavy_prompt: int = 512
    chunk_size: int = 128  # the ChunkSize heavy prompt (the profile's knee)
    decode_batch: int = 16
    short_context: int = 64
    long_context: int = 1024
    repeats: int = 5
    out: str = "results/interference"


class _Bench:
    def __init__(self) -> None:
        import torch

        from common.block_pool import KVCacheManager
        from common.config import CacheConfig, EngineConfig
        from common.engine.model_runner import ModelRunner

        self.torch = torch
        self.runner = ModelRunner(EngineConfig(cache=CacheConfig(num_blocks=4096)))
        layout = self.runner.kv_layout
        self.kv = KVCacheManager(layout.num_blocks, layout.block_size)
        self.counter = 0

    def _tokens(self, n: int) -> list[int]:
        return self.torch.randint(100, 40000, (n,)).tolist()

    def prompt(self, n: int):
        from common.plan import ScheduledChunk
        from common.sampling_params import SamplingParams

        self.counter += 1
        seq_id = f"p{self.counter}"
        return ScheduledChunk(seq_id, self._tokens(n), 0, self.kv.grow(seq_id, n),
                              SamplingParams(temperature=0.0))

    def decode(self, context: int):
        """A sequence with `context` tokens of KV, ready for one decode step."""
        from common.plan import BatchPlan, ScheduledChunk
        from common.sampling_params import SamplingParams

        self.counter += 1
        seq_id = f"d{self.counter}"
        table = self.kv.grow(seq_id, context + 1)
        self.runner.execute(BatchPlan([ScheduledChunk(seq_id, self._tokens(context), 0, table)]))
        return ScheduledChunk(seq_id, self._tokens(1), context, table,
                              SamplingParams(temperature=0.0), 1)

    def seconds(self, chunks: list, repeats: int) -> float:
        from common.plan import BatchPlan

        plan = BatchPlan(chunks)
        self.runner.execute(plan)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.runner.execute(plan)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)


def prefill_prefill(b: _Bench, o: InterferenceOptions) -> dict:
    alone = b.seconds([b.prompt(o.light_prompt)], o.repeats)
    rows = {"LP alone": alone}
    for k in (7, 63):
        rows[f"LP + {k} LP"] = b.seconds([b.prompt(o.light_prompt) for _ in range(k + 1)],
                                         o.repeats)
    for size in (o.chunk_size, o.heavy_prompt):
        rows[f"LP + HP({size})"] = b.seconds([b.prompt(o.light_prompt), b.prompt(size)],
                                             o.repeats)
    return {name: {"seconds": s, "slowdown": s / alone} for name, s in rows.items()}


def decode_prefill(b: _Bench, o: InterferenceOptions) -> dict:
    decodes = [b.decode(o.short_context) for _ in range(o.decode_batch)]
    alone = b.seconds(decodes, o.repeats)
    rows = {f"{o.decode_batch} LD alone": alone}
    for size in (o.chunk_size, o.heavy_prompt):
        rows[f"{o.decode_batch} LD + HP({size})"] = b.seconds(decodes + [b.prompt(size)],
                                                             o.repeats)
    return {name: {"seconds": s, "slowdown": s / alone} for name, s in rows.items()}


def decode_decode(b: _Bench, o: InterferenceOptions) -> dict:
    light = [b.decode(o.short_context) for _ in range(2 * o.decode_batch)]
    mixed = light[: o.decode_batch] + [b.decode(o.long_context) for _ in range(o.decode_batch)]
    all_light, half_heavy = b.seconds(light, o.repeats), b.seconds(mixed, o.repeats)
    n = 2 * o.decode_batch
    return {f"{n} LD": {"seconds": all_light, "tokens_per_s": n / all_light, "slowdown": 1.0},
            f"{n // 2} LD + {n // 2} HD": {"seconds": half_heavy, "tokens_per_s": n / half_heavy,
                                           "slowdown": half_heavy / all_light}}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = ("prefill_prefill", "decode_prefill", "decode_decode")
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, group in zip(axes, groups):
        names = list(result[group])
        ax.bar(names, [result[group][n]["slowdown"] for n in names])
        ax.set(title=group.replace("_", " + "), ylabel="latency vs alone")
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_interference(options: InterferenceOptions) -> dict:
    bench = _Bench()
    result = {"options": asdict(options), "prefill_prefill": prefill_prefill(bench, options),
              "decode_prefill": decode_prefill(bench, options),
              "decode_decode": decode_decode(bench, options)}
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "interference.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "interference.png")
    for group in ("prefill_prefill", "decode_prefill", "decode_decode"):
        for name, row in result[group].items():
            print(f"{group:16s} {name:24s} {row['seconds'] * 1e3:8.1f} ms  x{row['slowdown']:.2f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, value in asdict(InterferenceOptions()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    run_interference(InterferenceOptions(**vars(parser.parse_args())))


if __name__ == "__main__":
    main()
