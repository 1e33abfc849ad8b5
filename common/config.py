"""The configuration tree: one frozen dataclass per concern, built once at the entry point.

Nothing here reads the environment or the command line; `control_plane.cli` does that and builds
these objects. Values discovered at run time (the number of KV blocks that fit, the model's shape)
are returned as their own objects by the code that discovers them, never written back here. A
config crosses a process boundary as JSON (`common.config_json`): `splitserve up` hands each
instance process its InstanceConfig that way. Plug-in names are checked against their
registries (`common.plugins`, which lists names without importing any plug-in).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING


from common.plugins import ADMISSION_POLICIES, PREFILL_POLICIES

if TYPE_CHECKING:
    from common.protocol import LengthPrediction

DTYPES = ("auto", "bfloat16", "float16", "float32")


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent; the message says which."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how."""

    # A Hugging Face directory (config.json + *.safetensors) or a .gguf file; None = default model.
    path: str | None = None
    # "auto" = float16 on CUDA; on CPU bfloat16 where the CPU runs it natively, else float32
    # (the caller says which: common.engine.cpu_features). float32 agrees exactly with transformers.
    dtype: str = "auto"
    device: str = "cpu"
    # Context limit in tokens; None = the checkpoint's max_position_embeddings.
    max_model_len: int | None = None
    # Where converted weights (GGUF -> safetensors) are cached; outside the repository.
    cache_dir: str = "~/.cache/splitserve"
    # torch intra-op threads for this process; None leaves torch's default.
    num_threads: int | None = None
    # Name the API reports in /v1/models; None = derived from the path.
    served_name: str | None = None
    # Decode steps on CUDA replay graphs captured at start-up (common.engine.cuda_graphs) for
    # batches up to cuda_graph_max_batch sequences (and up to BatchConfig.max_num_seqs).
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = 256

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.cuda_graph_max_batch > 0, "cuda_graph_max_batch must be > 0")
        _require(self.max_model_len is None or self.max_model_len > 0, "max_model_len must be > 0")
        _require(self.num_threads is None or self.num_threads > 0, "num_threads must be > 0")

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser()

    def resolved_dtype(self, cpu_default: str) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float16" if self.device.startswith("cuda") else cpu_default


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache of one instance."""

    block_size: int = 16
    # Number of KV blocks; None = as many as fit in memory_gib.
    num_blocks: int | None = None
    memory_gib: float = 1.0
    # Allocate the KV tensor in POSIX shared memory so a same-host peer can map it (shm transfer).
    shared_memory: bool = False
    # Share the KV of equal prompt prefixes between sequences (common.block_pool's prefix cache).
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                 f"block_size must be a power of two, got {self.block_size}")
        _require(self.num_blocks is None or self.num_blocks > 0, "num_blocks must be > 0")
        _require(self.memory_gib > 0, "memory_gib must be > 0")


@dataclass(frozen=True)
class BatchConfig:
    """Per-forward limits shared by every scheduler."""

    max_num_seqs: int = 128
    # Tokens per forward: ChunkSize for prefill instances, the token budget for coupled ones.
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        _require(self.max_num_seqs > 0, "max_num_seqs must be > 0")
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens must be > 0")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one loaded model needs: weights, KV cache and batch limits."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    seed: int = 0

    def with_model(self, **changes) -> EngineConfig:
        return replace(self, model=replace(self.model, **changes))


@dataclass(frozen=True)
class PrefillConfig:
    """The prefill role (TetriInfer §3.3)."""

    policy: str = "sjf"  # order of the scheduled queue: fcfs, sjf (shortest prompt first), ljf
    sched_batch: int = 16  # PrefillSchedBatch: raw requests sorted into the scheduled queue at once
    # Tokens per prefill forward (ChunkSize); 0 = the knee from `splitserve profile`, else 256.
    chunk_size: int = 0
    pad_last_chunk: bool = False  # zero-pad a short chunk up to ChunkSize, as the paper does
    lease_timeout_s: float = 30.0  # how long blocks wait for a decode instance to take them
    dispatch_policy: str = "power_of_two"  # a DISPATCH_POLICIES name (prefill_instance.dispatcher)

    def __post_init__(self) -> None:
        _require(self.policy in PREFILL_POLICIES, f"prefill policy must be one of "
                 f"{', '.join(PREFILL_POLICIES)}, got {self.policy!r}")
        _require(self.sched_batch > 0, "PrefillSchedBatch must be > 0")
        _require(self.chunk_size >= 0, "ChunkSize must be >= 0")
        _require(self.lease_timeout_s > 0, "lease timeout must be > 0")


FLIP_DRAINS = ("finish", "migrate")


@dataclass(frozen=True)
class DecodeConfig:
    """The decode role (TetriInfer §3.4)."""

    admission: str = "greedy"  # an ADMISSION_POLICIES name: greedy, reserve-static, ...
    preempt: str = "recompute"  # when memory runs out anyway: recompute or swap (host tier)
    swap_blocks: int | None = None  # host blocks for swap; None = as many as the device has
    swap_bandwidth: float | None = None  # emulated host-swap bandwidth, bytes/s
    # A flip away from decode: "finish" decodes what is held first; "migrate" hands every held
    # sequence back to its gateway at once, which recomputes its KV (prompt + generated tokens)
    # on a prefill instance and sends it on to another decode instance.
    flip_drain: str = "finish"

    def __post_init__(self) -> None:
        _require(self.flip_drain in FLIP_DRAINS,
                 f"flip drain must be one of {', '.join(FLIP_DRAINS)}, got {self.flip_drain!r}")
        _require(self.admission in ADMISSION_POLICIES, f"unknown decode admission policy "
                 f"{self.admission!r}; known: {', '.join(ADMISSION_POLICIES)}")
        _require(self.preempt in ("recompute", "swap"),
                 f"preempt must be recompute or swap, got {self.preempt!r}")


PREDICTOR_MODES = ("parallel", "sequential")


@dataclass(frozen=True)
class PredictionConfig:
    """The predicted output length (TetriInfer §3.3.2): where the prefill instance gets it, and
    how the dispatcher and the decode admission policies read it."""

    # A directory made by `splitserve predictor train`, "oracle" (max_tokens as the true
    # length: ignore-EOS workloads), or None (no prediction).
    predictor: str | None = None
    mode: str = "parallel"  # parallel (own thread beside the main model) or sequential
    oracle_granularity: int = 200  # bucket width of the oracle's predictions, in tokens
    heavy_threshold: int = 128  # predicted output tokens above which a decode is heavy
    use_upper_end: bool = False  # size sequences by the upper end of the predicted range

    def __post_init__(self) -> None:
        _require(self.mode in PREDICTOR_MODES,
                 f"predictor mode must be one of {PREDICTOR_MODES}, got {self.mode!r}")
        _require(self.oracle_granularity > 0, "oracle granularity must be > 0")
        _require(self.heavy_threshold >= 0, "heavy threshold must be >= 0")

    def predicted_output(self, prediction: LengthPrediction | None) -> int | None:
        """The output length placement plans for: one end of the predicted range."""
        if prediction is None:
            return None
        return prediction.upper if self.use_upper_end else prediction.lower

    def is_heavy(self, prediction: LengthPrediction | None) -> bool:
        output = self.predicted_output(prediction)
        return output is not None and output > self.heavy_threshold


BANDWIDTH_PRESETS = {"roce-200g": 200e9 / 8, "nvlink-300g": 300e9}  # bytes per second
OPT_13B_BYTES_PER_TOKEN = 819_200  # 2 (K,V) x 40 layers x 5120 hidden x 2 bytes (fp16)


@dataclass(frozen=True)
class EmulationConfig:
    """Pace KV delivery to a link slower than this host's: the real bytes still move, then the
    transfer waits until `latency_s + bytes / bandwidth` has passed since it started."""

    bandwidth: float | None = None  # bytes per second; None = no emulation
    latency_s: float = 0.0
    # Count this many bytes per token instead of the real ones (OPT-13B: 819,200), so a small
    # model reproduces the paper's transfer regime; 0 = the real byte count.
    bytes_per_token: int = 0

    def __post_init__(self) -> None:
        _require(self.bandwidth is None or self.bandwidth > 0, "bandwidth must be > 0")
        _require(self.latency_s >= 0 and self.bytes_per_token >= 0,
                 "latency and bytes per token must be >= 0")

    def duration(self, real_bytes: int, num_tokens: int) -> float:
        if self.bandwidth is None:
            return 0.0
        counted = self.bytes_per_token * num_tokens if self.bytes_per_token else real_bytes
        return self.latency_s + counted / self.bandwidth


@dataclass(frozen=True)
class TransferConfig:
    """How KV blocks move between instances."""

    backend: str = "tcp"  # tcp | shm | ucx | cuda_ipc (the kv_transfer registry)
    timeout_s: float = 30.0  # a read that takes longer fails
    # request: the decode instance reads a sequence's KV once its prompt is done (the paper);
    # chunk: each chunk's KV is read as soon as it is prefilled, overlapping the next chunk.
    granularity: str = "request"
    # What a failed hand-off does: recompute (the gateway runs the prefill again elsewhere) or
    # fail (the request ends with an error event).
    failure_policy: str = "recompute"
    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    port: int = 0  # KV endpoint port (0 = any free port)
    advertise_host: str | None = None  # address peers use (e.g. the pod IP); None = bind host
    # Fault injection for tests: "stall" = reads into this instance never complete (they fail
    # at their deadline); "" = none.
    fault: str = ""
    cluster_secret_file: str | None = None  # CurveZMQ on the KV endpoint (common.security)

    def __post_init__(self) -> None:
        _require(self.granularity in ("request", "chunk"),
                 f"granularity must be request or chunk, got {self.granularity!r}")
        _require(self.failure_policy in ("recompute", "fail"),
                 f"failure policy must be recompute or fail, got {self.failure_policy!r}")
        _require(self.timeout_s > 0, "transfer timeout must be > 0")
        _require(self.fault in ("", "stall"), f"unknown transfer fault {self.fault!r}")


@dataclass(frozen=True)
class InstanceConfig:
    """One instance process: its engine, its role, and how it reaches the control plane."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    role: str = "prefill"
    instance_id: str = ""
    host: str = "127.0.0.1"  # interface the inbox and KV endpoint bind to
    gateways: tuple[str, ...] = ()  # gateway inboxes that receive this instance's load reports
    report_interval_s: float = 0.1
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    prediction: PredictionConfig = field(default_factory=PredictionConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    # With a store URL (redis://...), load reports and broadcasts go through the store and
    # several gateways share the cluster; without, through the gateways' inboxes.
    store_url: str | None = None
    store_prefix: str = "splitserve"
    heartbeat_ttl_s: float = 2.0  # an instance silent this long is removed from the registry
    # Between forwards the loop reports; during one longer than the monitor's timeout (a long
    # prompt on a CPU) its last report is repeated, for at most this long: a loop stuck longer
    # than this stops reporting and is declared dead.
    stall_timeout_s: float = 120.0
    inbox_port: int = 0  # 0 = any free port
    advertise_host: str | None = None  # the address others reach this instance at (pod IP)
    # HTTP /health, /ready, /metrics; 0 = off, -1 = any free port (the reported metrics URL
    # carries the one bound, so nothing races for a port picked in advance)
    metrics_port: int = 0
    cluster_secret_file: str | None = None  # CurveZMQ on every internal socket (common.security)
    # The coupled role (co-located baselines): policy, host swap tier, policy knobs.
    coupled_policy: str = "sarathi"
    coupled_swap_blocks: int | None = None  # None = the policy's default
    coupled_swap_bandwidth: float | None = None  # bytes/s; None = memcpy speed
    coupled_options: tuple[tuple[str, float], ...] = ()
    # TBT SLO in seconds: the token budget becomes the largest forward the profile says fits it
    # (common.schedulers.costs.token_budget_for_tbt); None = engine.batch's budget as given.
    coupled_tbt_slo_s: float | None = None
    # A directory for the forward log (common.engine.forward_log: each forward's shape and
    # seconds, one JSON line); "" = off.
    forward_log_dir: str = ""

    def __post_init__(self) -> None:
        _require(self.report_interval_s > 0, "report interval must be > 0")
        _require(self.heartbeat_ttl_s > self.report_interval_s,
                 "the heartbeat TTL must exceed the report interval")
        _require(self.stall_timeout_s > 0, "stall timeout must be > 0")


@dataclass(frozen=True)
class LimitsConfig:
    """Admission control and input limits at the gateway; 0 means no limit."""

    max_body_bytes: int = 4 * 2**20
    max_prompt_tokens: int = 0  # 0 = the model's context
    max_output_tokens: int = 0  # 0 = the model's context
    max_streams_per_client: int = 0  # concurrent requests per API key (or client address)
    max_in_flight: int = 0  # requests running at this gateway
    max_prefill_queue_tokens: int = 0  # prompt tokens queued over all prefill instances
    # Seconds of prefill work queued at the least-loaded prefill instance, from its measured
    # tokens per forward-second: a bound on queueing delay that follows the machine's speed.
    max_prefill_queue_s: float = 0.0
    max_decode_waiting: int = 0  # sequences waiting for room over all decode instances
    retry_after_s: int = 1  # the Retry-After of 429 and 503 answers
    api_keys: tuple[str, ...] = ()  # Authorization: Bearer <key> required when set

    def __post_init__(self) -> None:
        _require(self.max_body_bytes > 0, "max body size must be > 0")
        _require(min(self.max_prompt_tokens, self.max_output_tokens, self.max_in_flight,
                     self.max_streams_per_client, self.max_prefill_queue_tokens,
                     self.max_decode_waiting) >= 0, "limits must be >= 0 (0 = none)")
        _require(self.max_prefill_queue_s >= 0, "limits must be >= 0 (0 = none)")
        _require(self.retry_after_s >= 0, "Retry-After must be >= 0")

    def __repr__(self) -> str:  # never print the keys
        return f"LimitsConfig(..., api_keys=<{len(self.api_keys)} keys>)"


@dataclass(frozen=True)
class RoutingConfig:
    """Where the gateway sends a request (control_plane/routing.py)."""

    # prefill instance choice, by name in common.plugins.ROUTE_POLICIES
    policy: str = "cache_aware"
    # cache_aware: prompt tokens of queued work one cached prompt token is worth
    overlap_weight: float = 1.0
    # conditional disaggregation: "off", "on" (threshold below), or "auto" (the largest prefill
    # the `splitserve profile` record shows within local_prefill_tbt_s, else the threshold)
    local_prefill: str = "auto"
    # a decode instance prefills a request itself when the prompt's part it has not cached is
    # at most this many tokens (and its queue is short)
    local_prefill_tokens: int = 512
    local_prefill_tbt_s: float = 0.1  # auto: the longest a decode step with a prefill may take

    def __post_init__(self) -> None:
        _require(self.local_prefill in ("off", "on", "auto"),
                 f"local_prefill must be off, on or auto, got {self.local_prefill!r}")
        _require(self.local_prefill_tokens >= 0, "local_prefill_tokens must be >= 0")
        _require(self.overlap_weight >= 0, "overlap_weight must be >= 0")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    inbox_port: int = 0  # 0 = any free port
    model: str | None = None  # for the tokenizer and the served name; None = default model
    served_name: str | None = None
    chat_template: str | None = None  # a Jinja file replacing the model's chat template
    cache_dir: str = "~/.cache/splitserve"
    request_timeout_s: float = 600.0  # a request never waits longer than this in total
    token_timeout_s: float = 60.0  # ... nor longer than this for its next token
    instance_timeout_s: float = 2.0  # an instance silent this long is declared dead
    broadcast_interval_s: float = 0.1  # cluster monitor broadcast to prefill instances
    store_url: str | None = None  # redis://... shared by gateway replicas; None = in-process
    store_prefix: str = "splitserve"
    gateway_id: str = ""  # unique per replica; "" = generated
    advertise_host: str | None = None  # the address instances reply to (pod IP); None = host
    graceful_shutdown_s: float = 30.0  # finish in-flight streams this long on SIGTERM
    # An idle client connection stays open this long. Longer than clients keep idle pooled
    # connections (aiohttp 15 s, httpx 5 s) and than load balancers' idle timeouts (60 s): a
    # client that reuses a pooled connection the server is closing at that moment gets
    # "Server disconnected" (uvicorn's own default of 5 s raced aiohttp's 15 s)
    keep_alive_s: float = 75.0
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    cluster_secret_file: str | None = None  # CurveZMQ on every internal socket
    max_recoveries: int = 2  # times a request is run again after its instance failed
    flip_policy: str = "none"  # transition watcher policy (control_plane.transition)
    flip_options: tuple[tuple[str, float], ...] = ()  # policy/watcher knobs, e.g. cooldown_s
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    def __post_init__(self) -> None:
        _require(0 < self.port < 65536, f"port must be in 1..65535, got {self.port}")
        _require(self.request_timeout_s > 0 and self.token_timeout_s > 0, "timeouts must be > 0")
        _require(self.keep_alive_s > 0, f"keep_alive_s must be > 0, got {self.keep_alive_s}")
