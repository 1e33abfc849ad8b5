"""The prefill role: admit -> chunk -> forward -> first token -> dispatch -> lease -> release.

1. Admit: a GenerateRequest becomes a Sequence in the raw queue (PrefillScheduler).
2. Chunk and forward: prefill-only chunks of ChunkSize tokens, merged across requests.
3. First token: sampled at the end of the prompt and streamed to the gateway at once (TTFT).
4. Dispatch (prefill_instance/handoff.py): the dispatcher picks a decode instance from the cluster
   monitor's last broadcast; the sequence's blocks are offered to it and held under a lease. With
   chunk-level transfer the offer goes out after the first chunk and each later chunk is
   announced as soon as it is computed, so the copy overlaps the rest of the prefill.
5. Release: KVTransferDone frees the blocks. A refused offer (the decode instance is draining)
   is offered elsewhere; a lease that expires frees the blocks and fails the request with an
   error event (recoverable under the `recompute` failure policy).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import cache

from common.engine.profile import recorded_chunk_size
from common.engine.worker import Role, RoleContext
from common.plan import BatchPlan, ModelOutput
from common.protocol import (
    AbortRequest,
    ClusterView,
    GenerateRequest,
    KVTransferDone,
    KVTransferOffer,
    Message,
    TokenUpdate,
)
from common.sequence import Sequence
from common.transfer import TransferStatus
from prefill_instance.dispatcher import DISPATCHERS, DispatchOptions
from prefill_instance.handoff import Handoffs
from prefill_instance.prediction import PrefillPredictor
from prefill_instance.scheduler import PrefillScheduler

log = logging.getLogger(__name__)
DEFAULT_CHUNK_SIZE = 256


@cache
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
        config = ctx.config.prefill
        prediction = ctx.config.prediction
        self.handoffs = Handoffs(ctx, DISPATCHERS.get(config.dispatch_policy)(DispatchOptions(
            prediction, block_size=ctx.kv.block_size)))
        self.predictor = PrefillPredictor(prediction) if prediction.predictor else None
        if self.predictor is not None:
            self.predictor.check_served_model(ctx.runner.model.shape)
        self.chunked = ctx.config.transfer.granularity == "chunk"
        self.recoverable = ctx.config.transfer.failure_policy == "recompute"
        self.routes: dict[str, str] = {}  # request id -> gateway inbox, until the first token

    # -- messages ------------------------------------------------------------------------------
    def handle(self, message: Message) -> None:
        if isinstance(message, GenerateRequest):
            self._admit(message)
        elif isinstance(message, AbortRequest):
            self._abort(message.request_id, message.reason)
        elif isinstance(message, ClusterView):
            self.handoffs.decodes = message.decodes
            for dead in message.dead:
                for request_id in self.handoffs.void_to(dead):
                    self._drop(request_id)
        elif isinstance(message, KVTransferDone):
            self._transfer_done(message)
        elif isinstance(message, KVTransferOffer):  # arrived after this instance flipped
            self.ctx.send(message.source_inbox, KVTransferDone.rejected(
                message.request_id, "not a decode instance"))

    def _admit(self, request: GenerateRequest) -> None:
        num_prompt = len(request.prompt_token_ids) - request.num_generated
        seq = Sequence(request.request_id, request.prompt_token_ids[:num_prompt], request.sampling,
                       self.ctx.runner.max_model_len)
        seq.token_ids = list(request.prompt_token_ids)  # a recovered request resumes its output
        seq.extra.update(reply_to=request.reply_to, deadline=request.deadline,
                         arrival_wall=request.arrival_time)
        self.routes[seq.seq_id] = request.reply_to
        if self.ctx.kv.num_blocks_for(seq.num_tokens + 1) > self.ctx.kv.num_blocks:
            self._fail(seq, "the prompt needs more KV blocks than this instance has")
            return
        if self.predictor is not None:
            self.predictor.admit(seq)
        self.scheduler.add(seq)

    def _drop(self, request_id: str) -> None:
        """Forget a request everywhere in this instance and free its blocks."""
        self.scheduler.abort(request_id)
        self.handoffs.undispatched = [s for s in self.handoffs.undispatched
                                      if s.seq_id != request_id]
        self.ctx.kv.free(request_id)
        self.routes.pop(request_id, None)
        if self.predictor is not None:
            self.predictor.discard(request_id)

    def _abort(self, request_id: str, reason: str) -> None:
        self.handoffs.forward_abort(request_id, reason)
        self._drop(request_id)

    def _transfer_done(self, done: KVTransferDone) -> None:
        lease = self.handoffs.release(done.request_id)
        if lease is None:
            return
        prefilling = done.request_id in self.scheduler.sequences
        if done.status is TransferStatus.REJECTED:
            # The decode instance never touched the blocks: offer them to another one (after the
            # prompt is done; a chunk-level offer is simply made again at the next chunk).
            self.handoffs.exclude(lease.decode.instance_id)
            if not prefilling:
                self.handoffs.undispatched.append(lease.seq)
            return
        if prefilling or not done.ok:
            self._drop(done.request_id)  # the decode side failed: the gateway decides what next
        else:
            self.ctx.kv.free(done.request_id)

    def _fail(self, seq: Sequence, error: str, recoverable: bool = False) -> None:
        self.routes.pop(seq.seq_id, None)
        self.ctx.emit(seq.extra["reply_to"], TokenUpdate(
            seq.seq_id, finish_reason="error", error=error, instance_id=self.ctx.instance_id,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            recoverable=recoverable))

    # -- background work -----------------------------------------------------------------------
    def poll(self) -> None:
        for lease in self.handoffs.expired():
            self.ctx.count("leases_expired")
            self.handoffs.forward_abort(lease.seq.seq_id, "lease expired")
            self._drop(lease.seq.seq_id)
            self._fail(lease.seq, f"KV transfer to {lease.decode.instance_id} timed out",
                       self.recoverable)
        self._expire_deadlines(time.time())
        waiting, self.handoffs.undispatched = self.handoffs.undispatched, []
        for seq in waiting:
            self._dispatch(seq, None)

    def _expire_deadlines(self, wall_now: float) -> None:
        for seq in list(self.scheduler.sequences.values()):
            deadline = seq.extra.get("deadline", 0.0)
            if deadline and wall_now > deadline:
                self._abort(seq.seq_id, "deadline")
                self._fail(seq, "request deadline exceeded before prefill finished")

    def _dispatch(self, seq: Sequence, first_update: TokenUpdate | None) -> None:
        """Request-level hand-off of a prefilled sequence (or hold it until a decode appears)."""
        decode = self.handoffs.offer(seq, final=True)
        if decode is None:
            self.handoffs.undispatched.append(seq)
            if first_update is not None:
                self.ctx.emit(self.routes[seq.seq_id], first_update)
            return
        update = first_update or TokenUpdate(seq.seq_id, instance_id=self.ctx.instance_id)
        update.next_instance = decode.instance_id
        # A sequence offered again after a decode instance rejected it has no route left: its
        # first hand-off used it; the gateway still learns where the sequence went.
        self.ctx.emit(self.routes.pop(seq.seq_id, seq.extra["reply_to"]), update)

    # -- forwards ------------------------------------------------------------------------------
    def schedule(self) -> BatchPlan:
        plan = self.scheduler.schedule()
        if self.predictor is not None and self.predictor.wants_hidden and not plan.is_empty:
            # The probe reads the last prompt token's hidden states.
            plan = replace(plan, return_hidden=True, hidden_layers=self.predictor.hidden_layers)
        return plan

    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> None:
        updates = {u.seq_id: u for u in self.scheduler.update_from_output(plan, output)}
        prefilled = {s.seq_id: s for s in self.scheduler.take_prefilled()}
        if self.predictor is not None:
            self.predictor.absorb(output.hidden, {**self.scheduler.sequences, **prefilled})
            for seq in prefilled.values():
                self.predictor.ensure(seq)
        for chunk in plan.chunks:
            seq_id, u = chunk.seq_id, updates.get(chunk.seq_id)
            if seq_id in prefilled:
                self._prompt_done(prefilled[seq_id], self._token_update(u))
            elif u is not None:  # finished by its first token (stop, max_tokens 1)
                self.handoffs.forward_abort(seq_id, "finished at prefill")
                if seq_id in self.routes:
                    self.ctx.emit(self.routes.pop(seq_id), self._token_update(u))
            elif self.chunked and seq_id in self.scheduler.sequences:
                self._chunk_done(self.scheduler.sequences[seq_id])

    def _token_update(self, u) -> TokenUpdate:
        return TokenUpdate(u.seq_id, u.new_token_ids, u.finish_reason, u.num_prompt_tokens,
                           u.num_output_tokens, self.ctx.instance_id)

    def _prompt_done(self, seq: Sequence, first_update: TokenUpdate) -> None:
        if seq.seq_id in self.handoffs.leases:  # chunk-level: already offered
            self.handoffs.notify(seq, final=True)
            self.ctx.emit(self.routes.pop(seq.seq_id), first_update)
        else:
            self._dispatch(seq, first_update)

    def _chunk_done(self, seq: Sequence) -> None:
        if seq.seq_id in self.handoffs.leases:
            self.handoffs.notify(seq, final=False)
            return
        decode = self.handoffs.offer(seq, final=False)
        if decode is not None:
            self.ctx.emit(self.routes[seq.seq_id], TokenUpdate(
                seq.seq_id, instance_id=self.ctx.instance_id, next_instance=decode.instance_id))

    # -- reporting -----------------------------------------------------------------------------
    def load(self) -> dict:
        running = sum(1 for s in self.scheduler.scheduled if s.num_computed_tokens > 0)
        return {"num_waiting": len(self.scheduler.sequences) - running, "num_running": running,
                "num_transferring": len(self.handoffs.leases) + len(self.handoffs.undispatched),
                "num_queued_tokens": self.scheduler.num_queued_tokens}

    def live_seq_ids(self) -> set[str]:
        return (set(self.scheduler.sequences) | set(self.handoffs.leases)
                | {s.seq_id for s in self.handoffs.undispatched})

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.raw or self.scheduler.scheduled)

    @property
    def is_drained(self) -> bool:
        return not (self.scheduler.sequences or self.handoffs.leases or self.handoffs.undispatched)

    def close(self) -> None:
        if self.predictor is not None:
            self.predictor.close()
