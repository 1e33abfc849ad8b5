"""Every message that crosses a process boundary, and the one codec for all of them.

Messages are msgspec structs tagged with their class name and encoded as MessagePack. Who sends
what:

    gateway  -> prefill   GenerateRequest, AbortRequest, ClusterView (cluster monitor broadcast,
                          over the gateway inbox or the store's pub/sub)
    gateway  -> decode    AbortRequest, GenerateRequest (local_prefill: conditional
                          disaggregation, the prompt is mostly in its prefix cache)
    gateway  -> instance  FlipCommand, Shutdown
    prefill  -> decode    KVTransferOffer (a prefilled sequence and where its KV blocks are),
                          KVChunkReady (chunk-level: more of its KV is ready)
    decode   -> prefill   KVTransferDone (lease released: the blocks may be freed)
    instance -> gateway   InstanceStats (every report interval, or to the store), TokenBatch
                          (generated tokens), FlipReport, KVCacheEvents (prefix-cache
                          changes, over the gateway inbox or the store's pub/sub)

Every request has one id, set by the gateway, that every later message carries.
"""

from __future__ import annotations

from typing import Union

import msgspec

from common.sampling_params import SamplingParams
from common.transfer import TransferStatus


class Message(msgspec.Struct, tag=True, omit_defaults=True):
    """Base of all wire messages."""


class LengthPrediction(msgspec.Struct, frozen=True):
    """A predicted output length, in tokens: bucket `bucket` of the predictor's granularity,
    `lower <= length < upper`. For a predictor's last bucket `upper` is the length cap it was
    trained with; a sequence allowed to generate more may go past it."""

    bucket: int
    lower: int
    upper: int


class GenerateRequest(Message):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str  # the inbox of the gateway that streams this request
    arrival_time: float  # wall clock (time.time()) at the gateway
    deadline: float = 0.0  # wall clock after which the request is dropped; 0 = none
    # A recovered request: the last `num_generated` tokens of prompt_token_ids were already
    # generated (and streamed) by an instance that failed; they count as output.
    num_generated: int = 0
    # Conditional disaggregation: sent to a decode instance that holds most of the prompt in its
    # prefix cache, which prefills the rest itself instead of receiving it from a prefill one.
    local_prefill: bool = False
    # Cache-aware dispatch: decode instance id -> prompt tokens the gateway's prefix index says
    # it holds cached (only instances holding some; the dispatcher ranks its choices by it).
    decode_cached_tokens: dict[str, int] = {}


class AbortRequest(Message):
    request_id: str
    reason: str = "abort"


class PeerInfo(msgspec.Struct, omit_defaults=True):
    """What a prefill instance needs to know about one decode instance."""

    instance_id: str
    inbox: str
    kv_endpoint: str
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_heavy: int = 0  # running decodes predicted heavy
    num_light: int = 0
    # As the monitor builds it (control_plane/cluster.py: decode_peer): num_running, num_heavy
    # and num_light count every sequence offered there and not finished (waiting, being read,
    # decoding); num_free_blocks leaves out the blocks waiting offers will take.
    # Prefill instance id -> the number of its last offer received (prefill_instance/placements.py)
    offers_seen: dict[str, int] = {}
    report_time: float = 0.0  # the decode instance's clock at that report (orders reports)


class ClusterView(Message):
    decodes: list[PeerInfo]  # ready decode instances that accept new sequences
    timestamp: float = 0.0
    dead: list[str] = []  # instances declared dead recently: leases held for them are void
    # False while the cluster starts and an instance it was launched with has not reported yet:
    # `decodes` may be missing some, so a prefill instance places nothing from this view.
    complete: bool = True


class FlipCommand(Message):
    """Drain, then switch this instance to `target_role` (no model reload)."""

    flip_id: str
    target_role: str


class FlipReport(Message):
    flip_id: str
    instance_id: str
    from_role: str
    to_role: str
    drain_seconds: float
    switch_seconds: float  # constructing the new role, drain excluded
    timestamp: float = 0.0
    num_migrated: int = 0  # sequences handed back to their gateways instead of finished here


class KVTransferOffer(Message):
    """A prefilled sequence ready to decode; its KV is in `block_ids` at `kv_endpoint`."""

    request_id: str
    token_ids: list[int]  # prompt + the first generated token
    num_prompt_tokens: int
    sampling: SamplingParams
    reply_to: str
    source_instance: str
    source_inbox: str
    kv_endpoint: str
    block_ids: list[int]
    num_cached_tokens: int  # tokens whose KV the blocks hold so far
    lease_expires: float  # wall clock: the prefill instance frees the blocks after this
    arrival_time: float = 0.0
    deadline: float = 0.0  # the request's deadline (wall clock); 0 = none
    # False for chunk-level hand-offs: more chunks follow (KVChunkReady) and token_ids holds no
    # generated token yet.
    final: bool = True
    prediction: LengthPrediction | None = None  # the length predictor's bucket for this sequence
    # Increasing per prefill process; the decode instance reports the last one it received from
    # each prefill instance (InstanceStats.offers_seen; prefill_instance/placements.py)
    offer_number: int = 0
    # The prefix-cache hashes of the blocks the prefill instance registered for these tokens
    # (common.block_pool's chain, same block size): the decode instance takes them instead of
    # hashing the same prompt again
    block_hashes: list[int] = []


class KVChunkReady(Message):
    """Chunk-level hand-off: the KV of the first `num_cached_tokens` tokens is now in
    `block_ids`; with `final`, the prompt is done and token_ids ends with the first token."""

    request_id: str
    block_ids: list[int]
    num_cached_tokens: int
    final: bool = False
    token_ids: list[int] = []
    lease_expires: float = 0.0  # the lease, extended by every notice
    prediction: LengthPrediction | None = None  # once known


class KVTransferDone(Message):
    """What became of an offer's blocks on the decode side: DONE (copied: free them), REJECTED
    (never touched: offer them elsewhere), FAILED or ABORTED. `error` is the why, for people;
    code reads `status`."""

    request_id: str
    status: TransferStatus = TransferStatus.DONE
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status is TransferStatus.DONE

    @classmethod
    def rejected(cls, request_id: str, why: str) -> KVTransferDone:
        return cls(request_id, TransferStatus.REJECTED, f"rejected: {why}")


class InstanceStats(Message):
    """Load report; the first one registers the instance with a gateway."""

    instance_id: str
    role: str
    inbox: str
    kv_endpoint: str
    model: str
    max_model_len: int
    num_total_blocks: int
    num_free_blocks: int
    # what its forwards' time depends on besides their shapes, for matching a profile record
    # (common.profile_record); "" and 0 = not said
    dtype: str = ""
    num_threads: int = 0
    num_waiting: int = 0  # queued, not started (prefill raw + scheduled; decode offers)
    num_running: int = 0  # prefilling or decoding now
    num_transferring: int = 0  # KV leases held (prefill) or reads in flight (decode)
    num_queued_tokens: int = 0  # prompt tokens not yet prefilled (prefill) or waiting (decode)
    busy_seconds: float = 0.0  # wall time spent in forwards since start
    num_forwards: int = 0  # forwards since start
    forward_turn_seconds: float = 0.0  # wall time of the loop turns that ran them, since start
    num_computed_tokens: int = 0  # tokens computed in those forwards (not padding), since start
    timestamp: float = 0.0
    pid: int = 0
    draining: bool = False  # flipping: route no new work here
    num_heavy_decodes: int = 0  # running decodes predicted heavy (output > 128 tokens)
    num_light_decodes: int = 0
    metrics_url: str = ""  # http://host:port of /health, /ready, /metrics; "" = not served
    # Decode instances, cumulative since start (experiments read them from GET /cluster):
    num_preemptions: int = 0
    # Decode and coupled instances, cumulative since start: what the scheduling policy did
    # (QueueScheduler.counters: preemptions, recomputes, swaps; FastServe adds its queues').
    policy_counters: dict[str, int] = {}
    num_finished_heavy: int = 0  # finished sequences whose prediction said heavy
    num_finished_light: int = 0
    first_admit_time: float = 0.0  # wall clock of the first sequence admitted
    last_finish_time: float = 0.0  # wall clock of the last sequence finished
    # Decode instances, now: offers held and not decoding yet (waiting for admission or being
    # read), by prediction; the blocks the waiting ones will take on admission (those being read
    # hold theirs already); prefill instance id -> the number of the last offer received from it.
    num_incoming_heavy: int = 0
    num_incoming_light: int = 0
    num_reserved_blocks: int = 0
    offers_seen: dict[str, int] = {}
    # Prefix cache, cumulative since start (hit rate = hit / query tokens), and blocks cached now;
    # decode instances: blocks of received sequences read from a prefill instance or found here.
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_cached_blocks: int = 0
    kv_blocks_read: int = 0
    kv_blocks_skipped: int = 0
    num_local_prefills: int = 0  # decode: requests it prefilled itself (conditional disagg.)
    # Gateway inbox -> GenerateRequests received from it since start (counted before the report
    # is made): the gateway keeps counting its later sends as queued here.
    requests_seen: dict[str, int] = {}


class KVCacheEvents(Message):
    """An instance's prefix-cache changes since its last events (block hashes of
    common.block_pool, chained over `block_size`-token blocks); with `snapshot`, `stored` is
    every hash cached now and replaces what was known. Gateways route by them."""

    instance_id: str
    block_size: int
    stored: list[int] = []
    removed: list[int] = []
    snapshot: bool = False


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One position's log-probabilities (the model's raw distribution): the chosen token's
    (sampled, or the prompt's next token), its rank (1 = likeliest), and the likeliest
    `len(top_ids)` tokens' (SamplingParams.logprobs / prompt_logprobs of them)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class TokenUpdate(msgspec.Struct, omit_defaults=True):
    request_id: str
    token_ids: list[int] = []
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    instance_id: str = ""
    next_instance: str = ""  # the decode instance a prefill handed the request to
    error: str = ""
    recoverable: bool = False  # the error lost no output: the gateway may run it again elsewhere
    bad_request: bool = False  # the error is the request's own (a grammar that does not compile)
    logprobs: list[TokenLogprobs] = []  # one per token_ids, when the request asked
    # With the first token, when the request asked: prompt tokens 1.. (the first has none)
    prompt_logprobs: list[TokenLogprobs] = []


class TokenBatch(Message):
    items: list[TokenUpdate]


class Shutdown(Message):
    pass


AnyMessage = Union[GenerateRequest, AbortRequest, ClusterView, KVTransferOffer, KVTransferDone,
                   InstanceStats, TokenBatch, Shutdown, FlipCommand, FlipReport, KVChunkReady,
                   KVCacheEvents]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


class CodecError(ValueError):
    """Bytes that are not a valid message."""


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise CodecError(str(exc)) from None
