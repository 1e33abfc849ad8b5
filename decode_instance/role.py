"""The decode role: offer -> allocate -> read KV -> confirm -> decode -> stream -> free.

1. Offer: a KVTransferOffer from a prefill instance waits in the receive queue.
2. Allocate: when the pool has room for the prompt plus the next token (greedy admission, as
   vLLM admits), blocks are taken and a read of the prefill instance's blocks is submitted.
3. Confirm: when the read lands, KVTransferDone tells the prefill instance to free its copy and
   the sequence joins the running batch; a failed read frees our blocks, releases the prefill's
   lease, and ends the request with an error event.
4. Decode: continuous batching, one token per running sequence per forward, each token streamed
   to the request's gateway; blocks are freed when the sequence ends or is aborted.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from common.engine.worker import Role, RoleContext
from common.plan import BatchPlan, ModelOutput
from common.protocol import (AbortRequest, GenerateRequest, KVTransferDone, KVTransferOffer,
                             Message, TokenUpdate)
from common.transfer_errors import REJECTED
from common.sequence import Sequence
from decode_instance.scheduler import DecodeScheduler
from kv_transfer import ReadJob, TransferResult

log = logging.getLogger(__name__)
LEASE_MARGIN_S = 1.0  # finish reading this long before the prefill's lease expires
RECENT_ABORT_S = 60.0


class DecodeRole(Role):
    name = "decode"

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.scheduler = DecodeScheduler(ctx.config.engine.batch, ctx.kv)
        self.offers: deque[KVTransferOffer] = deque()
        self.reading: dict[str, KVTransferOffer] = {}
        self.aborted_reads: set[str] = set()
        # Aborts can overtake their offer (they come from the gateway, offers from a prefill
        # instance): remember recent ones so a late offer is refused, not decoded for nobody.
        self.recent_aborts: dict[str, float] = {}

    # -- messages ------------------------------------------------------------------------------
    def handle(self, message: Message) -> None:
        if isinstance(message, KVTransferOffer):
            if message.request_id in self.recent_aborts:
                self.ctx.send(message.source_inbox,
                              KVTransferDone(message.request_id, False, "aborted"))
            elif self.draining:
                self._reject(message, "draining")
            else:
                self.offers.append(message)
        elif isinstance(message, AbortRequest):
            self._abort(message.request_id)
        elif isinstance(message, GenerateRequest):  # arrived after this instance flipped
            self.ctx.emit(message.reply_to, TokenUpdate(
                message.request_id, finish_reason="error", error="not a prefill instance",
                instance_id=self.ctx.instance_id, recoverable=True))

    def _reject(self, offer: KVTransferOffer, why: str) -> None:
        self.ctx.send(offer.source_inbox, KVTransferDone(offer.request_id, False, REJECTED + why))

    def begin_drain(self) -> None:
        super().begin_drain()
        while self.offers:  # not started: the prefill instances offer them elsewhere
            self._reject(self.offers.popleft(), "draining")

    def _abort(self, request_id: str) -> None:
        now = time.monotonic()
        self.recent_aborts[request_id] = now
        for old in [k for k, t in self.recent_aborts.items() if now - t > RECENT_ABORT_S]:
            del self.recent_aborts[old]
        for offer in list(self.offers):
            if offer.request_id == request_id:
                self.offers.remove(offer)
                self.ctx.send(offer.source_inbox, KVTransferDone(request_id, False, "aborted"))
        if request_id in self.reading:
            self.aborted_reads.add(request_id)
            self.ctx.transfer.cancel(request_id)
        self.scheduler.abort(request_id)

    # -- receiving -----------------------------------------------------------------------------
    def poll(self) -> None:
        for result in self.ctx.transfer.poll():
            self._finish_read(result)
        while self.offers and self._start_read(self.offers[0]):
            self.offers.popleft()
        self._expire_deadlines(time.time())

    def _start_read(self, offer: KVTransferOffer) -> bool:
        """Allocate blocks and submit the read; False when the pool is short (offer waits)."""
        remaining = min(self.ctx.config.transfer.timeout_s,
                        offer.lease_expires - time.time() - LEASE_MARGIN_S)
        if remaining <= 0:
            self.ctx.send(offer.source_inbox, KVTransferDone(offer.request_id, False, "expired"))
            self._fail_offer(offer, "KV transfer lease expired before the decode instance had room",
                             recoverable=True)
            return True
        table = self.ctx.kv.grow(offer.request_id, offer.num_cached_tokens + 1)
        if table is None:
            return False
        self.reading[offer.request_id] = offer
        self.ctx.transfer.submit(ReadJob(offer.request_id, offer.kv_endpoint, offer.block_ids,
                                         table[:len(offer.block_ids)],
                                         time.monotonic() + remaining))
        return True

    def _finish_read(self, result: TransferResult) -> None:
        offer = self.reading.pop(result.request_id)
        aborted = result.request_id in self.aborted_reads
        self.aborted_reads.discard(result.request_id)
        if not result.ok or aborted:
            self.ctx.kv.free(offer.request_id)
            self.ctx.send(offer.source_inbox, KVTransferDone(offer.request_id, False,
                                                             result.error or "aborted"))
            if not aborted:
                self._fail_offer(offer, f"KV transfer failed: {result.error}", recoverable=True)
            return
        self.ctx.send(offer.source_inbox, KVTransferDone(offer.request_id))
        seq = Sequence(offer.request_id, offer.token_ids[:offer.num_prompt_tokens], offer.sampling,
                       self.ctx.runner.max_model_len)
        seq.token_ids = list(offer.token_ids)
        seq.num_computed_tokens = offer.num_cached_tokens
        seq.block_ids = self.ctx.kv.table(offer.request_id)
        seq.extra.update(reply_to=offer.reply_to, deadline=offer.deadline)
        self.scheduler.add_prefilled(seq)

    def _fail_offer(self, offer: KVTransferOffer, error: str, recoverable: bool = False) -> None:
        self.ctx.emit(offer.reply_to, TokenUpdate(
            offer.request_id, finish_reason="error", error=error,
            num_prompt_tokens=offer.num_prompt_tokens,
            num_output_tokens=len(offer.token_ids) - offer.num_prompt_tokens,
            instance_id=self.ctx.instance_id, recoverable=recoverable))

    def _expire_deadlines(self, wall_now: float) -> None:
        for seq in list(self.scheduler.sequences.values()):
            deadline = seq.extra.get("deadline", 0.0)
            if deadline and wall_now > deadline:
                self.scheduler.abort(seq.seq_id)
                self.ctx.emit(seq.extra["reply_to"], TokenUpdate(
                    seq.seq_id, finish_reason="error", error="request deadline exceeded",
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_output_tokens=seq.num_output_tokens, instance_id=self.ctx.instance_id))

    # -- forwards ------------------------------------------------------------------------------
    def schedule(self) -> BatchPlan:
        return self.scheduler.schedule()

    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> None:
        reply_to = {c.seq_id: self.scheduler.sequences[c.seq_id].extra["reply_to"]
                    for c in plan.chunks if c.seq_id in self.scheduler.sequences}
        for u in self.scheduler.update_from_output(plan, output):
            self.ctx.emit(reply_to[u.seq_id], TokenUpdate(
                u.seq_id, u.new_token_ids, u.finish_reason, u.num_prompt_tokens,
                u.num_output_tokens, self.ctx.instance_id))

    # -- reporting -----------------------------------------------------------------------------
    def load(self) -> dict:
        return {"num_waiting": len(self.offers), "num_running": self.scheduler.num_running,
                "num_transferring": len(self.reading),
                "num_queued_tokens": sum(o.num_cached_tokens for o in self.offers)}

    def live_seq_ids(self) -> set[str]:
        return set(self.scheduler.sequences) | set(self.reading)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def is_drained(self) -> bool:
        return not (self.offers or self.reading or self.scheduler.has_work)

    @property
    def wait_s(self) -> float:
        return 0.001 if self.reading else super().wait_s
