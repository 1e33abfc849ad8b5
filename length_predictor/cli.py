"""`splitserve predictor ...` subcommands: one `add_*_args(parser)` + `run_*(args)` pair each.

The control plane's CLI owns the parser tree and calls these. Nothing heavy is imported at module
level (no torch, no transformers): each `run_*` imports what it needs. Bad input raises
`InvalidRequestError` / `ConfigError` with a one-line message for the CLI to print.

    build-dataset  ShareGPT prompts (the split's train / eval ranges) + length labels
                   -> DIR/{train,eval}.jsonl, metadata.json
    train          one predictor per granularity -> OUT/g<G>/ (+ the eval table when asked)
    eval           accuracy, +-1 accuracy, majority baseline, confusion PNG, results JSON
    overhead       main-model prefill with vs without the predictor beside it
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.config import CacheConfig, EngineConfig, ModelConfig
from common.errors import InvalidRequestError

DEFAULT_CACHE_DIR = "~/.cache/splitserve"


def _add_model_args(parser: argparse.ArgumentParser, default_cache_dir: str,
                    kv_memory_gib: float) -> None:
    group = parser.add_argument_group("target model")
    group.add_argument("--model", default=None,
                       help="target model: HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    group.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16",
                                                            "float32"])
    group.add_argument("--threads", type=int, default=None, help="torch threads")
    group.add_argument("--kv-memory-gib", type=float, default=kv_memory_gib)
    group.add_argument("--max-num-seqs", type=int, default=128, help="sequences per forward")
    group.add_argument("--cache-dir", default=default_cache_dir,
                       help="converted-weights cache")


def target_engine_config(args: argparse.Namespace) -> EngineConfig:
    from common.config import BatchConfig

    return EngineConfig(
        model=ModelConfig(path=args.model, dtype=args.dtype, cache_dir=args.cache_dir,
                          num_threads=args.threads),
        cache=CacheConfig(memory_gib=args.kv_memory_gib),
        batch=BatchConfig(max_num_seqs=args.max_num_seqs))


# -- build-dataset ---------------------------------------------------------------------------------
def add_build_dataset_args(parser: argparse.ArgumentParser,
                           default_cache_dir: str = DEFAULT_CACHE_DIR) -> None:
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--labels", default="engine", choices=["engine", "reference"],
                        help="engine: greedy output length of the target model; reference: "
                             "the ShareGPT reply re-tokenized with the target tokenizer")
    parser.add_argument("--turns", default="first", choices=["first", "all"],
                        help="first user turn of each conversation, or every round")
    parser.add_argument("--limit", type=int, default=None,
                        help="train + eval pairs to keep (default: the split's train and eval "
                             "ranges whole)")
    parser.add_argument("--seed", type=int, default=0, help="order within each range")
    parser.add_argument("--eval-fraction", type=float, default=None,
                        help="with --limit: its share taken from the eval range (default: the "
                             "ranges' ratio, 0.2)")
    parser.add_argument("--max-output-tokens", type=int, default=512,
                        help="generation cap and bucket cap")
    parser.add_argument("--sharegpt", default=None, help="ShareGPT JSON file (default: packaged)")
    _add_model_args(parser, default_cache_dir, kv_memory_gib=4.0)


def run_build_dataset(args: argparse.Namespace) -> int:
    from length_predictor.dataset import DatasetOptions, build_dataset

    options = DatasetOptions(labels=args.labels, turns=args.turns, limit=args.limit,
                             seed=args.seed, eval_fraction=args.eval_fraction,
                             max_output_tokens=args.max_output_tokens,
                             sharegpt_path=args.sharegpt)
    metadata = build_dataset(options, target_engine_config(args), Path(args.out))
    print(json.dumps(metadata, indent=2))
    return 0


# -- train -----------------------------------------------------------------------------------------
def add_train_args(parser: argparse.ArgumentParser,
                   default_cache_dir: str = DEFAULT_CACHE_DIR) -> None:
    parser.add_argument("--kind", required=True, choices=["classifier", "probe"])
    parser.add_argument("--dataset", required=True, help="directory from build-dataset")
    parser.add_argument("--out", required=True,
                        help="predictor directory (OUT/g<G>/ each when several granularities)")
    parser.add_argument("--granularity", default="200",
                        help="bucket size in tokens, or a list: 100,200,400 (one predictor each)")
    parser.add_argument("--max-output-tokens", type=int, default=None,
                        help="bucket cap (default: the dataset's generation cap)")
    parser.add_argument("--max-input-tokens", type=int, default=512,
                        help="cutting limit: inputs keep their first and last halves")
    parser.add_argument("--no-eval", action="store_true", help="skip the eval-split scoring")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", help="target model dtype (probe features)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--cache-dir", default=default_cache_dir)
    probe = parser.add_argument_group("probe")
    probe.add_argument("--probe-hidden", type=int, default=256,
                       help="MLP width; 0 = logistic regression")
    probe.add_argument("--probe-epochs", type=int, default=60)
    probe.add_argument("--probe-lr", type=float, default=1e-3)
    probe.add_argument("--probe-layers", default="auto",
                       help="hidden states read, HF numbering (k = after k decoder layers, the "
                            "layer count = the final state): a list like 15,30, 'final', or "
                            "'auto' (every third layer from the middle up)")
    probe.add_argument("--probe-heads-per-layer", type=int, default=5,
                       help="heads (seeds) per layer; the prediction averages all heads")
    clf = parser.add_argument_group("classifier")
    clf.add_argument("--backbone", default=None,
                     help="local HF checkpoint (default: the target model's directory)")
    clf.add_argument("--num-layers", type=int, default=18,
                     help="keep the backbone's bottom N layers (0 = all)")
    clf.add_argument("--train-layers", type=int, default=2,
                     help="top layers trained with the head (-1 = full fine-tuning)")
    clf.add_argument("--max-steps", type=int, default=400)
    clf.add_argument("--batch-size", type=int, default=16)
    clf.add_argument("--learning-rate", type=float, default=3e-4)
    clf.add_argument("--no-bf16", action="store_true", help="train in float32")


def _probe_layers(text: str) -> tuple[int, ...] | None:
    """None = the default rule; 'final' = (-1,), resolved to the layer count at training."""
    if text == "auto":
        return None
    if text == "final":
        return (-1,)
    try:
        layers = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise InvalidRequestError(f"--probe-layers: expected auto, final or a list of layer "
                                  f"numbers, got {text!r}") from None
    if any(layer < 0 for layer in layers):
        raise InvalidRequestError(f"--probe-layers: layer numbers start at 0, got {text!r}")
    return layers


def _kind_options(args: argparse.Namespace):
    if args.kind == "probe":
        from length_predictor.probe import ProbeOptions

        return ProbeOptions(hidden_size=args.probe_hidden, epochs=args.probe_epochs,
                            learning_rate=args.probe_lr, seed=args.seed,
                            layers=_probe_layers(args.probe_layers),
                            heads_per_layer=args.probe_heads_per_layer)
    import torch

    from common.engine.cpu_features import default_cpu_dtype
    from length_predictor.classifier import ClassifierOptions

    # bfloat16 autocast is a slowdown on CPUs without native bfloat16 matmuls.
    native_bf16 = torch.cuda.is_available() or default_cpu_dtype() == "bfloat16"
    return ClassifierOptions(backbone=args.backbone, num_layers=args.num_layers,
                             train_layers=args.train_layers, max_steps=args.max_steps,
                             batch_size=args.batch_size, learning_rate=args.learning_rate,
                             bf16=not args.no_bf16 and native_bf16, seed=args.seed)


def run_train(args: argparse.Namespace) -> int:
    from length_predictor.buckets import parse_granularities
    from length_predictor.evaluate import markdown_table
    from length_predictor.train import TrainOptions, train

    options = TrainOptions(kind=args.kind, granularities=parse_granularities(args.granularity),
                           max_output_tokens=args.max_output_tokens,
                           max_input_tokens=args.max_input_tokens, evaluate=not args.no_eval,
                           dtype=args.dtype, cache_dir=args.cache_dir)
    kind_options = _kind_options(args)  # validates flags before anything heavy loads
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    results = train(Path(args.dataset), Path(args.out), options, kind_options)
    print(markdown_table(results) if options.evaluate else json.dumps(results, indent=2))
    return 0


# -- eval ------------------------------------------------------------------------------------------
def add_eval_args(parser: argparse.ArgumentParser,
                  default_cache_dir: str = DEFAULT_CACHE_DIR) -> None:
    parser.add_argument("--predictor", required=True, action="append",
                        help="predictor directory, or a directory of them (repeatable)")
    parser.add_argument("--dataset", required=True, help="directory from build-dataset")
    parser.add_argument("--out", default=None,
                        help="results directory (default: <predictor>/eval-<dataset name>)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache-dir", default=default_cache_dir)


def run_eval(args: argparse.Namespace) -> int:
    from length_predictor.evaluate import evaluate_dirs, markdown_table

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    results = evaluate_dirs([Path(p) for p in args.predictor], Path(args.dataset),
                            Path(args.out) if args.out else None, args.cache_dir)
    print(markdown_table(results))
    return 0


# -- overhead --------------------------------------------------------------------------------------
def add_overhead_args(parser: argparse.ArgumentParser,
                      default_cache_dir: str = DEFAULT_CACHE_DIR) -> None:
    parser.add_argument("--predictor", required=True, help="a trained predictor directory")
    parser.add_argument("--mode", default="parallel", choices=["parallel", "sequential"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=256, help="main-model ChunkSize")
    parser.add_argument("--max-prompt-tokens", type=int, default=2048)
    parser.add_argument("--cutting-limit", type=int, default=512)
    parser.add_argument("--predictor-batch", type=int, default=16, help="prompts per batch")
    parser.add_argument("--repeats", type=int, default=3, help="alternating passes of each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", help="main model dtype")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache-dir", default=default_cache_dir)
    parser.add_argument("--out", default=None, help="write the report as JSON here")


def run_overhead(args: argparse.Namespace) -> int:
    from length_predictor.base import LoadOptions, load_predictor
    from length_predictor.overhead import OverheadOptions, format_report, measure_overhead
    from length_predictor.serving import ServiceOptions

    options = OverheadOptions(
        num_prompts=args.num_prompts, chunk_size=args.chunk_size,
        max_prompt_tokens=args.max_prompt_tokens, seed=args.seed, repeats=args.repeats,
        service=ServiceOptions(mode=args.mode, cutting_limit=args.cutting_limit,
                               max_batch_size=args.predictor_batch))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    predictor = load_predictor(args.predictor, LoadOptions(cache_dir=args.cache_dir))
    # The main model is the one the predictor learned lengths for.
    model = ModelConfig(path=predictor.meta.target_model_path, dtype=args.dtype,
                        cache_dir=args.cache_dir)
    try:
        report = measure_overhead(predictor, model, options)
    finally:
        predictor.close()
    print(format_report(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0
