"""The prefill role: admit -> chunk -> forward -> first token -> dispatch -> lease -> release.

1. Admit: a GenerateRequest becomes a Sequence in the raw queue (PrefillScheduler).
2. Chunk and forward: prefill-only chunks of ChunkSize tokens, merged across requests.
3. First token: sampled at the end of the prompt and streamed to the gateway at once (TTFT).
4. Dispatch: the dispatcher picks a decode instance from the cluster monitor's last broadcast;
   the sequence's blocks are offered to it (KVTransferOffer) and held under a lease.
5. Release: KVTransferDone from the decode instance frees the blocks; a lease that expires
   frees them too and fails the request with an error event.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import lru_cache

from common.engine.profile import recorded_chunk_size
from common.engine.worker import Role, RoleContext
from common.plan import BatchPlan, ModelOutput
from common.protocol import (AbortRequest, ClusterView, GenerateRequest, KVTransferDone,
                             KVTransferOffer, Message, PeerInfo, TokenUpdate)
from common.transfer_errors import REJECTED
from common.sequence import Sequence
from prefill_instance.dispatcher import DISPATCHERS
from prefill_instance.scheduler import PrefillScheduler

log = logging.getLogger(__name__)
DEFAULT_CHUNK_SIZE = 256


@dataclass
class Lease:
    seq: Sequence
    decode: PeerInfo
    expires: float  # time.monotonic()


@lru_cache(maxsize=None)
def _recorded_chunk_size(cache_dir: str) -> int | None:
    return recorded_chunk_size(cache_dir)


def chunk_size_for(ctx: RoleContext) -> int:
    """ChunkSize: configured, else the knee `splitserve profile` recorded, else a default."""
    configured = ctx.config.prefill.chunk_size
    if configured:
        return configured
    return _recorded_chunk_size(ctx.config.engine.model.cache_dir) or DEFAULT_CHUNK_SIZE


class PrefillRole(Role):
    name = "prefill"

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.chunk_size = chunk_size_for(ctx)
        self.scheduler = PrefillScheduler(ctx.config.prefill, self.chunk_size, ctx.kv)
        self.dispatcher = DISPATCHERS.get("round_robin")()
        self.decodes: list[PeerInfo] = []
        self.undispatched: list[Sequence] = []
        self.leases: dict[str, Lease] = {}
        self.routes: dict[str, str] = {}  # request id -> gateway inbox, while the request is here
        log.info("prefill role: ChunkSize %d, policy %s", self.chunk_size,
                 ctx.config.prefill.policy)

    # -- messages ------------------------------------------------------------------------------
    def handle(self, message: Message) -> None:
        if isinstance(message, GenerateRequest):
            self._admit(message)
        elif isinstance(message, AbortRequest):
            self._abort(message.request_id, message.reason)
        elif isinstance(message, ClusterView):
            self.decodes = message.decodes
            for dead in message.dead:
                self._void_leases_to(dead)
        elif isinstance(message, KVTransferDone):
            self._transfer_done(message)
        elif isinstance(message, KVTransferOffer):  # arrived after this instance flipped
            self.ctx.send(message.source_inbox, KVTransferDone(
                message.request_id, False, REJECTED + "not a decode instance"))

    def _admit(self, request: GenerateRequest) -> None:
        num_prompt = len(request.prompt_token_ids) - request.num_generated
        seq = Sequence(request.request_id, request.prompt_token_ids[:num_prompt], request.sampling,
                       self.ctx.runner.max_model_len)
        seq.token_ids = list(request.prompt_token_ids)  # a recovered request resumes its output
        seq.extra.update(reply_to=request.reply_to, deadline=request.deadline,
                         arrival_wall=request.arrival_time)
        self.routes[seq.seq_id] = request.reply_to
        if self.ctx.kv.num_blocks_for(seq.num_prompt_tokens + 1) > self.ctx.kv.num_blocks:
            self._fail(seq, "the prompt needs more KV blocks than this instance has")
            return
        self.scheduler.add(seq)

    def _abort(self, request_id: str, reason: str) -> None:
        self.scheduler.abort(request_id)
        self.undispatched = [s for s in self.undispatched if s.seq_id != request_id]
        lease = self.leases.pop(request_id, None)
        if lease is not None:  # after the offer on the same connection, so it cannot overtake it
            self.ctx.send(lease.decode.inbox, AbortRequest(request_id, reason))
        self.ctx.kv.free(request_id)
        self.routes.pop(request_id, None)

    def _transfer_done(self, done: KVTransferDone) -> None:
        lease = self.leases.pop(done.request_id, None)
        if lease is None:
            return
        if not done.ok and done.error.startswith(REJECTED):
            # The decode instance never touched the blocks (draining, or no longer a decode
            # instance): offer the sequence to another one.
            self.decodes = [d for d in self.decodes if d.instance_id != lease.decode.instance_id]
            self.routes[done.request_id] = lease.seq.extra["reply_to"]
            self.undispatched.append(lease.seq)
            return
        self.ctx.kv.free(done.request_id)

    def _void_leases_to(self, instance_id: str) -> None:
        for request_id, lease in list(self.leases.items()):
            if lease.decode.instance_id == instance_id:
                del self.leases[request_id]
                self.ctx.kv.free(request_id)

    def _fail(self, seq: Sequence, error: str, recoverable: bool = False) -> None:
        self.routes.pop(seq.seq_id, None)
        self.ctx.emit(seq.extra["reply_to"], TokenUpdate(
            seq.seq_id, finish_reason="error", error=error, instance_id=self.ctx.instance_id,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            recoverable=recoverable))

    # -- background work -----------------------------------------------------------------------
    def poll(self) -> None:
        now = time.monotonic()
        for request_id, lease in list(self.leases.items()):
            if now > lease.expires:
                del self.leases[request_id]
                self.ctx.kv.free(request_id)
                self.ctx.send(lease.decode.inbox, AbortRequest(request_id, "lease expired"))
                self._fail(lease.seq, f"KV transfer to {lease.decode.instance_id} timed out",
                           recoverable=True)
        self._expire_deadlines(time.time())
        if self.undispatched and self.decodes:
            waiting, self.undispatched = self.undispatched, []
            for seq in waiting:
                self._dispatch(seq, None)

    def _expire_deadlines(self, wall_now: float) -> None:
        for seq in list(self.scheduler.sequences.values()):
            deadline = seq.extra.get("deadline", 0.0)
            if deadline and wall_now > deadline:
                self.scheduler.abort(seq.seq_id)
                self._fail(seq, "request deadline exceeded before prefill finished")

    def _dispatch(self, seq: Sequence, first_update: TokenUpdate | None) -> None:
        decode = self.dispatcher.pick(seq, self.decodes)
        if decode is None:
            self.undispatched.append(seq)
            if first_update is not None:
                self.ctx.emit(seq.extra["reply_to"], first_update)
            return
        lease_s = self.ctx.config.prefill.lease_timeout_s
        self.leases[seq.seq_id] = Lease(seq, decode, time.monotonic() + lease_s)
        self.ctx.send(decode.inbox, KVTransferOffer(
            request_id=seq.seq_id, token_ids=seq.token_ids, num_prompt_tokens=seq.num_prompt_tokens,
            sampling=seq.sampling, reply_to=seq.extra["reply_to"],
            source_instance=self.ctx.instance_id, source_inbox=self.ctx.inbox_address,
            kv_endpoint=self.ctx.transfer.endpoint, block_ids=list(self.ctx.kv.table(seq.seq_id)),
            num_cached_tokens=seq.num_computed_tokens, lease_expires=time.time() + lease_s,
            arrival_time=seq.extra["arrival_wall"], deadline=seq.extra["deadline"]))
        update = first_update or TokenUpdate(seq.seq_id, instance_id=self.ctx.instance_id)
        update.next_instance = decode.instance_id
        self.ctx.emit(self.routes.pop(seq.seq_id), update)

    # -- forwards ------------------------------------------------------------------------------
    def schedule(self) -> BatchPlan:
        return self.scheduler.schedule()

    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> None:
        updates = {u.seq_id: u for u in self.scheduler.update_from_output(plan, output)}
        prefilled = {s.seq_id: s for s in self.scheduler.take_prefilled()}
        for seq_id, u in updates.items():
            token_update = TokenUpdate(seq_id, u.new_token_ids, u.finish_reason,
                                       u.num_prompt_tokens, u.num_output_tokens,
                                       self.ctx.instance_id)
            if seq_id in prefilled:
                self._dispatch(prefilled[seq_id], token_update)
            elif seq_id in self.routes:  # finished by its first token (stop, max_tokens 1)
                self.ctx.emit(self.routes.pop(seq_id), token_update)

    # -- reporting -----------------------------------------------------------------------------
    def load(self) -> dict:
        running = sum(1 for s in self.scheduler.scheduled if s.num_computed_tokens > 0)
        return {"num_waiting": len(self.scheduler.sequences) - running, "num_running": running,
                "num_transferring": len(self.leases) + len(self.undispatched),
                "num_queued_tokens": self.scheduler.num_queued_tokens}

    def live_seq_ids(self) -> set[str]:
        return (set(self.scheduler.sequences) | set(self.leases)
                | {s.seq_id for s in self.undispatched})

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.raw or self.scheduler.scheduled)

    @property
    def is_drained(self) -> bool:
        return not (self.scheduler.sequences or self.leases or self.undispatched)
