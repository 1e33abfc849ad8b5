"""E2 (SARATHI Table 2): what a decode costs alone, and piggybacked on a prefill chunk.

SARATHI's decode-maximal batch fuses one prefill chunk with the running decodes in one forward:
the weights are read once for both, so on a GPU a decode token that rides along costs about a
tenth of a decode-only step's (LLaMA-13B on an A6000: 12.49 -> 1.2 ms per decode token). This
measures the same three forwards on the engine directly (no cluster), per shape:

- prefill alone: one chunk of C tokens (the per-prefill-token cost);
- decode only: a batch of sequences of `context` tokens take one token each (the
  per-decode-token cost without piggybacking);
- decode-maximal: the same chunk and d decodes in one forward; a piggybacked decode costs the
  marginal time, (hybrid - the chunk alone) / d.

Shapes: the paper's (a 1021-token chunk + 3 decodes of 1024 tokens, against a decode-only batch
of 4) and ChunkSize-sized ones. Each forward is the median of `repeats` after a warm-up; the
whole set is measured `runs` times, and the table gives each ratio's mean and its range over
the runs. The speed-up is per decode token: decode-only / piggybacked.

    splitserve bench piggyback --out docs/benchmarks/e2_piggyback
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    chunk: int  # prefill tokens in the decode-maximal forward
    decodes: int  # decodes riding on it
    decode_only_batch: int  # the decode-only batch it is compared with (paper: decodes + 1)
    context: int  # tokens of KV each decode attends to


SHAPES = (Shape(1021, 3, 4, 1024),  # SARATHI Table 2 (LLaMA-13B, A6000)
          Shape(128, 16, 16, 256), Shape(512, 16, 16, 256))


@dataclass(frozen=True)
class PiggybackOptions:
    repeats: int = 5
    runs: int = 3
    out: str = "results/e2_piggyback"


def measure_shape(bench, shape: Shape, repeats: int) -> dict:
    """One run of one shape: seconds of the three forwards and the per-token costs."""
    decodes = [bench.decode(shape.context) for _ in range(max(shape.decodes,
                                                              shape.decode_only_batch))]
    chunk = bench.prompt(shape.chunk)
    prefill_s = bench.seconds([chunk], repeats)
    decode_s = bench.seconds(decodes[:shape.decode_only_batch], repeats)
    # decodes first, as the schedulers plan a hybrid forward (the runner sorts them first too)
    hybrid_s = bench.seconds([*decodes[:shape.decodes], chunk], repeats)
    alone = decode_s / shape.decode_only_batch
    riding = max(hybrid_s - prefill_s, 0.0) / shape.decodes
    return {"prefill_s": prefill_s, "decode_only_s": decode_s, "hybrid_s": hybrid_s,
            "per_prefill_token_ms": 1e3 * prefill_s / shape.chunk,
            "per_decode_token_alone_ms": 1e3 * alone,
            "per_decode_token_piggybacked_ms": 1e3 * riding,
            "speedup": alone / riding if riding > 0 else None}


def summarize(runs: list[dict]) -> dict:
    """Mean and range over runs of each per-token cost and of the speed-up."""
    keys = ("per_prefill_token_ms", "per_decode_token_alone_ms",
            "per_decode_token_piggybacked_ms", "speedup")
    out = {}
    for key in keys:
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = ({"mean": statistics.mean(values), "min": min(values), "max": max(values)}
                    if values else None)
    return out


def run_piggyback(options: PiggybackOptions) -> dict:
    from bench.interference import _Bench
    from bench.machine import cpu_kind

    bench = _Bench()
    measured = {f"{s.chunk}+{s.decodes}": [] for s in SHAPES}
    for _ in range(options.runs):
        for shape in SHAPES:
            measured[f"{shape.chunk}+{shape.decodes}"].append(
                measure_shape(bench, shape, options.repeats))
    result = {"options": asdict(options), "machine": {"cpu": cpu_kind()},
              "dtype": bench.runner.dtype_name,
              "threads": bench.torch.get_num_threads(),
              "shapes": {f"{s.chunk}+{s.decodes}": asdict(s) for s in SHAPES},
              "runs": measured,
              "summary": {name: summarize(rows) for name, rows in measured.items()}}
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "piggyback.json").write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    return result


def format_table(result: dict) -> str:
    header = ("| shape | per prefill token (ms) | per decode token alone (ms) | "
              "piggybacked (ms) | speed-up (range) |")
    lines = [header, "|---|---|---|---|---|"]
    for name, s in result["summary"].items():
        shape = result["shapes"][name]
        speed = s["speedup"]
        speed_text = (f"{speed['mean']:.1f}x ({speed['min']:.1f}-{speed['max']:.1f})"
                      if speed else "n/a")
        lines.append(
            f"| {shape['chunk']}-token chunk + {shape['decodes']} decodes of "
            f"{shape['context']} vs decode-only batch {shape['decode_only_batch']} | "
            f"{s['per_prefill_token_ms']['mean']:.3f} | "
            f"{s['per_decode_token_alone_ms']['mean']:.2f} | "
            f"{s['per_decode_token_piggybacked_ms']['mean']:.2f} | {speed_text} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="splitserve bench piggyback",
                                     description=__doc__.split("\n")[0])
    for name, value in asdict(PiggybackOptions()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    run_piggyback(PiggybackOptions(**vars(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
