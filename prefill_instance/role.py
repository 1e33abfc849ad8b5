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
from functools import cache

from common.engine.profile import recorded_chunk_size
from common.engine.role import Role, RoleContext
from common.plan import BatchPlan, ModelOutput
from common.plugins import DISPATCH_POLICIES
from common.profile_record import ProfileIdentity, read_record, served_identity
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
from prefill_instance.dispatcher import DispatchOptions
from prefill_instance.handoff import Handoffs
from prefill_instance.prediction import PrefillPredictor
from prefill_instance.scheduler import PrefillScheduler

log = logging.getLogger(__name__)
DEFAULT_CHUNK_SIZE = 256


@cache
def _recorded_chunk_size(cache_dir: str, identity: ProfileIdentity) -> int | None:
    chunk_size = recorded_chunk_size(cache_dir, identity)
    if chunk_size is None and read_record(cache_dir) is not None:
        log.warning("prefill role: the profile record in %s was measured for other forwards "
                    "than %s; ChunkSize %d (run `splitserve profile` with them)", cache_dir,
                    identity, DEFAULT_CHUNK_SIZE)
    return chunk_size


def chunk_size_for(ctx: RoleContext) -> int:
    """ChunkSize: configured, else the knee `splitserve profile` recorded for this runner's
    model, dtype and threads, else a default."""
    configured = ctx.config.prefill.chunk_size
    if configured:
        return configured
    return _recorded_chunk_size(ctx.config.engine.model.cache_dir,
                                served_identity(ctx.runner)) or DEFAULT_CHUNK_SIZE


class PrefillRole(Role):
    name = "prefill"
    scheduler: PrefillScheduler

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.chunk_size = chunk_size_for(ctx)
        self.scheduler = PrefillScheduler(ctx.config.prefill, self.chunk_size, ctx.kv)
        prediction = ctx.config.prediction
        self.handoffs = Handoffs(ctx, DISPATCH_POLICIES.get(ctx.config.prefill.dispatch_policy)(
            DispatchOptions(prediction, block_size=ctx.kv.block_size)))
        self.predictor = PrefillPredictor(prediction)  # does nothing when none is configured
        if prediction.predictor:
            self.predictor.check_served_model(ctx.runner.model.shape)
        self.chunked = ctx.config.transfer.granularity == "chunk"
        self.recoverable = ctx.config.transfer.failure_policy == "recompute"
        self.routes: dict[str, str] = {}  # request id -> gateway inbox, until the first token

    # -- messages ------------------------------------------------------------------------------
    def handle(self, message: Message) -> None:
        if isinstance(message, GenerateRequest):
            self._admit(message)
        elif isinstance(message, AbortRequest):
            self.discard(message.request_id, message.reason)
        elif isinstance(message, ClusterView):
            for request_id in self.handoffs.see(message):
                self._drop(request_id)
        elif isinstance(message, KVTransferDone):
            self._transfer_done(message)
        elif isinstance(message, KVTransferOffer):  # arrived after this instance flipped
            self.refuse_offer(message)

    def _admit(self, request: GenerateRequest) -> None:
        seq = self.sequence_for(request)
        if not self.fits_or_fail(seq):
            return
        self.routes[seq.seq_id] = request.reply_to
        self.predictor.admit(seq)
        self.admit_guided(seq, self.scheduler.add)

    def _drop(self, request_id: str) -> None:
        """Forget a request everywhere in this instance and free its blocks."""
        self.scheduler.abort(request_id)
        self.drop_compiling(request_id)
        self.handoffs.drop_held(request_id)
        self.ctx.kv.free(request_id)
        self.routes.pop(request_id, None)
        self.predictor.discard(request_id)

    def discard(self, seq_id: str, reason: str) -> None:
        """Drop the request here and at the decode instance it was handed to, if any."""
        self.handoffs.forward_abort(seq_id, reason)
        self._drop(seq_id)

    def _transfer_done(self, done: KVTransferDone) -> None:
        lease = self.handoffs.release(done.request_id)
        if lease is None:
            return
        prefilling = done.request_id in self.scheduler
        if done.status is TransferStatus.REJECTED:
            # The decode instance never touched the blocks: offer them to another one (after the
            # prompt is done; a chunk-level offer is simply made again at the next chunk).
            self.handoffs.exclude(lease.decode.instance_id)
            if not prefilling:
                self.handoffs.hold(lease.seq)
            return
        if prefilling or not done.ok:
            self._drop(done.request_id)  # the decode side failed: the gateway decides what next
        else:
            self.ctx.kv.free(done.request_id)

    # -- background work -----------------------------------------------------------------------
    def poll(self) -> None:
        for lease in self.handoffs.expired():
            self.ctx.count("leases_expired")
            self.discard(lease.seq.seq_id, "lease expired")
            self.fail(lease.seq, f"KV transfer to {lease.decode.instance_id} timed out",
                      self.recoverable)
        self.expire_deadlines("request deadline exceeded before prefill finished")
        for seq in self.handoffs.take_held():
            self._dispatch(seq, None)

    def _dispatch(self, seq: Sequence, first_update: TokenUpdate | None) -> None:
        """Request-level hand-off of a prefilled sequence (or hold it until a decode appears)."""
        decode = self.handoffs.offer(seq, final=True)
        if decode is None:
            self.handoffs.hold(seq)
            if first_update is not None:
                self.ctx.emit(self.routes[seq.seq_id], first_update)
            return
        update = first_update or TokenUpdate(seq.seq_id, instance_id=self.ctx.instance_id)
        update.next_instance = decode.instance_id
        # A sequence offered again after a decode instance rejected it has no route left: its
        # first hand-off used it; the gateway still learns where the sequence went.
        self.ctx.emit(self.routes.pop(seq.seq_id, seq.meta.reply_to), update)

    # -- forwards ------------------------------------------------------------------------------
    def schedule(self) -> BatchPlan:
        return self.predictor.prepare(self.scheduler.schedule())

    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> None:
        updates = {u.seq_id: u for u in self.scheduler.update_from_output(plan, output)}
        prefilled = {s.seq_id: s for s in self.scheduler.take_prefilled()}
        self.predictor.absorb(output.hidden,
                              lambda seq_id: prefilled.get(seq_id) or self.scheduler.get(seq_id))
        for seq in prefilled.values():
            self.predictor.ensure(seq)
        for chunk in plan.chunks:
            seq_id, u = chunk.seq_id, updates.get(chunk.seq_id)
            if seq_id in prefilled:
                self._prompt_done(prefilled[seq_id], self.token_update(u))
            elif u is not None:  # finished by its first token (stop, max_tokens 1)
                self.handoffs.forward_abort(seq_id, "finished at prefill")
                if seq_id in self.routes:
                    self.ctx.emit(self.routes.pop(seq_id), self.token_update(u))
            elif self.chunked:
                self._chunk_done(seq_id)

    def _prompt_done(self, seq: Sequence, first_update: TokenUpdate) -> None:
        if self.handoffs.has_lease(seq.seq_id):  # chunk-level: already offered
            self.handoffs.notify(seq, final=True)
            self.ctx.emit(self.routes.pop(seq.seq_id), first_update)
        else:
            self._dispatch(seq, first_update)

    def _chunk_done(self, seq_id: str) -> None:
        seq = self.scheduler.get(seq_id)
        if seq is None:  # aborted while its chunk ran
            return
        if self.handoffs.has_lease(seq_id):
            self.handoffs.notify(seq, final=False)
            return
        decode = self.handoffs.offer(seq, final=False)
        if decode is not None:
            self.ctx.emit(self.routes[seq_id], TokenUpdate(
                seq_id, instance_id=self.ctx.instance_id, next_instance=decode.instance_id))

    # -- reporting -----------------------------------------------------------------------------
    def load(self) -> dict:
        return {"num_waiting": self.scheduler.num_waiting,
                "num_running": self.scheduler.num_running,
                "num_transferring": self.handoffs.num_transferring,
                "num_queued_tokens": self.scheduler.num_queued_tokens}

    def live_seq_ids(self) -> set[str]:
        return super().live_seq_ids() | self.handoffs.seq_ids()

    @property
    def is_drained(self) -> bool:
        return not self.live_seq_ids()

    def close(self) -> None:
        self.predictor.close()
