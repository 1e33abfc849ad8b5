"""The `splitserve` command: parses arguments, builds the config tree, dispatches.

Every subcommand's implementation is imported inside its handler, so `splitserve gateway` never
loads torch and `splitserve --help` is instant. Expected failures (bad model path, bad input)
print one line on stderr and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from dataclasses import replace

from common.config import ConfigError, InstanceConfig
from common.config_json import config_from_json
from common.errors import SplitserveError
from common.plugins import ROLES
from control_plane.cli_args import (
    CACHE_ENV,
    add_engine_args,
    add_gateway_args,
    add_instance_args,
    add_plugin_arg,
    add_store_args,
    cluster_instance_config,
    engine_config,
    gateway_config,
    instance_config,
    refuse_flags_beside,
)


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


def received_instance_config(args: argparse.Namespace) -> InstanceConfig:
    """The config of `splitserve instance`: whole, as `splitserve up` hands it over
    (--config-json), or from the flags of an instance started by hand."""
    if args.config_json is None:
        return instance_config(args)
    refuse_flags_beside(args, build_parser().parse_args(["instance"]), "--config-json")
    return config_from_json(args.config_json, InstanceConfig)


def _cmd_instance(args: argparse.Namespace) -> int:
    config = received_instance_config(args)
    from common.engine.worker import InstanceWorker

    InstanceWorker(config).run()
    return 0


def _add_instance(sub) -> None:
    p = sub.add_parser("instance", help="one prefill, decode or coupled instance process")
    add_plugin_arg(p, "--role", ROLES, None, "the role (required unless --config-json)")
    p.add_argument("--config-json", default=None, metavar="JSON",
                   help="the whole instance config as JSON (common.config.InstanceConfig), as "
                        "`splitserve up` passes it; no other instance flag goes with it")
    p.add_argument("--gateway", action="append",
                   help="a gateway inbox (tcp://host:port) to report to (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind the inbox and KV to")
    p.add_argument("--instance-id", default=None)
    p.add_argument("--advertise-host", default=None,
                   help="address peers use to reach this instance (e.g. the pod IP)")
    p.add_argument("--inbox-port", type=int, default=0, help="message inbox (0 = any)")
    p.add_argument("--kv-port", type=int, default=0, help="KV transfer endpoint (0 = any)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="HTTP /health, /ready and /metrics (0 = off, -1 = any free port)")
    add_store_args(p)
    add_instance_args(p)
    add_engine_args(p)
    p.set_defaults(handler=_cmd_instance)


def _cmd_gateway(args: argparse.Namespace) -> int:
    from control_plane.launcher import build_gateway, serve_gateway

    gateway, aliases = build_gateway(gateway_config(args, args.inbox_port))
    print(f"splitserve gateway: http://{args.host}:{args.port}, instance reports to "
          f"tcp://{args.host}:{args.inbox_port}", flush=True)
    serve_gateway(gateway, aliases)
    return 0


def _add_gateway(sub) -> None:
    p = sub.add_parser("gateway", help="the HTTP gateway and global scheduler")
    add_gateway_args(p)
    p.add_argument("--inbox-port", type=int, default=8001,
                   help="port instances send reports and tokens to")
    p.add_argument("--advertise-host", default=None,
                   help="address instances reply to (e.g. the pod IP)")
    p.add_argument("--model", default=None, help="model path (tokenizer and served name)")
    p.add_argument("--cache-dir", default=os.environ.get(CACHE_ENV, "~/.cache/splitserve"))
    add_store_args(p)
    p.set_defaults(handler=_cmd_gateway)


def _cmd_up(args: argparse.Namespace) -> int:
    from pathlib import Path

    from common.process import free_port
    from control_plane.launcher import run_up

    shared = cluster_instance_config(args)
    shared = replace(shared, engine=shared.engine.with_model(
        num_threads=args.threads_per_instance))
    config = gateway_config(args, free_port(args.host))
    run_up(config, {"prefill": args.prefill, "decode": args.decode, "coupled": args.coupled},
           shared, Path(args.log_dir) if args.log_dir else None,
           threads={"prefill": args.prefill_threads} if args.prefill_threads else {})
    return 0


def _add_up(sub) -> None:
    p = sub.add_parser("up", help="gateway + prefill + decode instances on this machine")
    add_gateway_args(p)
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--coupled", type=int, default=0,
                   help="coupled instances (co-located policy, see --policy); use with "
                        "--prefill 0 --decode 0 for a co-located cluster")
    p.add_argument("--threads-per-instance", type=int, default=1)
    p.add_argument("--prefill-threads", type=int, default=None,
                   help="torch threads of each prefill instance (default: "
                        "--threads-per-instance)")
    p.add_argument("--log-dir", default=None, help="write each instance's log here")
    add_store_args(p)
    add_instance_args(p)
    add_engine_args(p)
    p.set_defaults(handler=_cmd_up)


def _cmd_bench(args: argparse.Namespace) -> int:
    from bench.run import options_from_args, run_bench

    run_bench(options_from_args(args))
    return 0


def _add_bench(sub) -> None:
    from bench.run import add_bench_args

    p = sub.add_parser("bench", help="load a running server with ShareGPT requests; "
                                     f"experiments: bench {{{','.join(BENCH_EXPERIMENTS)}}} ...")
    add_bench_args(p)
    p.set_defaults(handler=_cmd_bench)


def _simulator_command(sub, name: str, help_text: str, add_own: str, module: str,
                       counts: bool = False) -> None:
    """`simulate` and `plan`: `up`'s cluster flags plus their own (simulator.args.`add_own`,
    argparse only: building the parser stays light); the handler builds the configs as `up`
    does and calls `module`.run_from_args."""
    from simulator import args as simulator_args

    p = sub.add_parser(name, help=help_text)
    add_gateway_args(p)
    if counts:
        p.add_argument("--prefill", type=int, default=1, help="prefill instances")
        p.add_argument("--decode", type=int, default=1, help="decode instances")
        p.add_argument("--coupled", type=int, default=0, help="coupled instances (see --policy)")
    add_store_args(p)
    add_instance_args(p)
    add_engine_args(p)
    getattr(simulator_args, add_own)(p)

    def handler(args: argparse.Namespace) -> int:
        run_from_args = importlib.import_module(module).run_from_args
        return run_from_args(args, cluster_instance_config(args), gateway_config(args, 0))
    p.set_defaults(handler=handler)


def _add_simulate(sub) -> None:
    _simulator_command(sub, "simulate", "discrete-event simulation of a cluster (the real "
                       "policies, a profiled cost model); `up`'s flags", "add_simulate_args",
                       "simulator.cli", counts=True)


def _add_plan(sub) -> None:
    _simulator_command(sub, "plan", "simulate candidate layouts for an instance budget and "
                       "recommend one by goodput; `up`'s flags are the base", "add_plan_args",
                       "simulator.plan_cli")


_PREDICTOR_COMMANDS = {
    "build-dataset": ("ShareGPT prompts + output-length labels for training",
                      "add_build_dataset_args", "run_build_dataset"),
    "train": ("train a length predictor (probe or classifier)", "add_train_args", "run_train"),
    "eval": ("accuracy of trained predictors on a dataset's eval split", "add_eval_args",
             "run_eval"),
    "overhead": ("main-model prefill with vs without the predictor beside it",
                 "add_overhead_args", "run_overhead"),
}


def _add_predictor(sub) -> None:
    from length_predictor import cli as predictor_cli

    p = sub.add_parser("predictor", help="build, train, evaluate and time the length predictor")
    actions = p.add_subparsers(dest="predictor_command", required=True)
    cache_dir = os.environ.get(CACHE_ENV, "~/.cache/splitserve")
    for name, (help_text, add_name, run_name) in _PREDICTOR_COMMANDS.items():
        action = actions.add_parser(name, help=help_text)
        getattr(predictor_cli, add_name)(action, default_cache_dir=cache_dir)
        action.set_defaults(handler=getattr(predictor_cli, run_name))


class _OneLineErrors(argparse.ArgumentParser):
    """Bad flags end in one line naming the problem (argparse's default prints the whole usage
    first, dozens of lines once every registry lists its names)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(prog="splitserve", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


_COMMANDS = [_add_up, _add_gateway, _add_instance, _add_generate, _add_profile, _add_bench,
             _add_simulate, _add_plan, _add_predictor]


# `splitserve bench <experiment> ...` hands the rest of the command line to the experiment.
BENCH_EXPERIMENTS = {
    "compare": "bench.compare", "phase-shift": "bench.phase_shift",
    "transfer-emulation": "bench.transfer_emulation",
    "transfer-throughput": "bench.transfer_throughput",
    "decode-experiments": "bench.decode_experiments", "soak": "bench.soak",
    "interference": "bench.interference", "prefix-repeat": "bench.prefix_repeat",
    "overload": "bench.overload", "stack-ceiling": "bench.stack_ceiling",
    "guided-overhead": "bench.guided_overhead", "piggyback": "bench.piggyback",
}


def _bench_experiment(argv: list[str]) -> int | None:
    if len(argv) < 2 or argv[0] != "bench" or argv[1] not in BENCH_EXPERIMENTS:
        return None
    import importlib

    module = importlib.import_module(BENCH_EXPERIMENTS[argv[1]])
    sys.argv = [f"splitserve bench {argv[1]}", *argv[2:]]
    try:
        module.main()
    except (SplitserveError, ConfigError) as exc:
        print(f"splitserve bench {argv[1]}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    experiment = _bench_experiment(argv)
    if experiment is not None:
        return experiment
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
