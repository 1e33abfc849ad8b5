"""The decode instance's receiver: offers wait for room, then their KV is read into local blocks.

    KVTransferOffer --> pending (FIFO) --admit: blocks for prompt + 1 token--> transferring
    KVChunkReady    --> (chunk-level) read the newly ready blocks as they appear
    last job done   --> KVTransferDone to the prefill instance; the sequence is ready to decode

A hand-off is one read (request-level) or one read per chunk (chunk-level; the last partially
filled block is read again with the next chunk). Local blocks are freed only after every
submitted job has reported back, so no transfer can write into blocks that were reused.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from common.protocol import KVChunkReady, KVTransferDone, KVTransferOffer
from common.sequence import Sequence, SequenceMeta
from common.transfer import TransferJob, TransferResult, TransferStatus
from decode_instance.admission import SeqView

LEASE_MARGIN_S = 1.0  # finish reading this long before the prefill's lease expires


@dataclass
class HandOff:
    offer: KVTransferOffer
    num_requested: int = 0  # tokens whose blocks have been asked for (or were here already)
    outstanding: int = 0  # jobs submitted, result not yet seen
    complete: bool = False  # the final job succeeded
    failed: str = ""  # first error; set once
    aborted: bool = False
    local_blocks: list[int] = field(default_factory=list)
    num_skipped_blocks: int = 0  # leading blocks our prefix cache held: never read

    @property
    def final_known(self) -> bool:
        return self.offer.final


class Receiver:
    def __init__(self, ctx, admits=lambda offer: True) -> None:
        self.ctx = ctx
        self.admits = admits  # the decode admission policy's verdict on an offer
        self.pending: deque[HandOff] = deque()
        self.active: dict[str, HandOff] = {}
        self.ready: list[Sequence] = []  # received, to join the running batch
        self.failed: list[tuple[KVTransferOffer, str]] = []  # to report to the gateway
        # Blocks whose KV came over (a recovered request's output so far included) and blocks
        # our prefix cache held instead, since start.
        self.blocks_read = self.blocks_skipped = 0

    def find(self, request_id: str) -> HandOff | None:
        return self.active.get(request_id) or next(
            (h for h in self.pending if h.offer.request_id == request_id), None)

    def offer(self, offer: KVTransferOffer) -> None:
        self.pending.append(HandOff(offer))

    def chunk(self, message: KVChunkReady) -> None:
        handoff = self.find(message.request_id)
        if handoff is None or handoff.failed or handoff.aborted:
            return
        offer = handoff.offer
        offer.block_ids, offer.num_cached_tokens = message.block_ids, message.num_cached_tokens
        offer.final = message.final
        offer.lease_expires = message.lease_expires or offer.lease_expires
        offer.prediction = message.prediction or offer.prediction
        if message.final:
            offer.token_ids = message.token_ids
        if message.request_id in self.active:
            self._request_more(handoff)

    def reject_pending(self, why: str) -> None:
        while self.pending:
            offer = self.pending.popleft().offer
            self.ctx.send(offer.source_inbox, KVTransferDone.rejected(offer.request_id, why))

    def abort(self, request_id: str) -> None:
        for handoff in list(self.pending):
            if handoff.offer.request_id == request_id:
                self.pending.remove(handoff)
                self._release_source(handoff, TransferStatus.ABORTED, "aborted")
        handoff = self.active.get(request_id)
        if handoff is not None:
            handoff.aborted = True
            self.ctx.transfer.cancel(request_id)
            self._maybe_close(handoff)

    def fail_from(self, instance_id: str) -> None:
        """The prefill instance `instance_id` died: its offers and transfers cannot complete."""
        for handoff in [h for h in self.pending if h.offer.source_instance == instance_id]:
            self.pending.remove(handoff)
            self.failed.append((handoff.offer, f"prefill instance {instance_id} failed"))
        for handoff in [h for h in self.active.values()
                        if h.offer.source_instance == instance_id and not h.complete]:
            if not handoff.failed:
                handoff.failed = f"prefill instance {instance_id} failed"
                self.ctx.transfer.cancel(handoff.offer.request_id)
            self._maybe_close(handoff)

    # -- admission and reads ---------------------------------------------------------------------
    def admit(self) -> None:
        while self.pending:
            handoff = self.pending[0]
            if self._expired(handoff):
                self.pending.popleft()
                self._release_source(handoff, TransferStatus.FAILED, "expired")
                self.failed.append((handoff.offer, "KV lease expired before this decode instance "
                                                   "had room"))
                continue
            if not self.admits(handoff.offer):
                return  # the admission policy says wait; in arrival order
            table = self._allocate(handoff)
            if table is None:
                return
            self.pending.popleft()
            handoff.local_blocks = table
            self.active[handoff.offer.request_id] = handoff
            self._request_more(handoff)

    def _allocate(self, handoff: HandOff) -> list[int] | None:
        """Local blocks for the prompt (+ output a recovered request already had) + the next
        token; the leading ones from our prefix cache when we hold that prefix (a later turn of
        a conversation we decoded), whose KV is then not read at all."""
        offer, kv = handoff.offer, self.ctx.kv
        have = kv.claim_prefix(offer.request_id, offer.token_ids, offer.num_prompt_tokens,
                               known=offer.block_hashes)
        table = kv.grow(offer.request_id, len(offer.token_ids) + 1)
        if table is None:
            kv.free(offer.request_id)
            return None
        handoff.num_requested = have  # our cached blocks count as requested: never read
        handoff.num_skipped_blocks = have // kv.block_size
        self.blocks_skipped += handoff.num_skipped_blocks
        self.ctx.count("transfer_blocks", handoff.num_skipped_blocks, kind="skipped")
        return table

    @staticmethod
    def _expired(handoff: HandOff) -> bool:
        return handoff.offer.lease_expires - time.time() - LEASE_MARGIN_S <= 0

    def _request_more(self, handoff: HandOff) -> None:
        """Submit a read for the blocks that became ready since the last one."""
        offer, block_size = handoff.offer, self.ctx.kv.block_size
        if offer.num_cached_tokens <= handoff.num_requested and not offer.final:
            return
        first = handoff.num_requested // block_size  # re-read a partly filled last block
        last = -(-offer.num_cached_tokens // block_size)
        if first >= last:  # every ready block was here already
            handoff.num_requested = max(handoff.num_requested, offer.num_cached_tokens)
            if offer.final:
                handoff.complete = True
                self._maybe_close(handoff)
            return
        remaining = min(self.ctx.config.transfer.timeout_s,
                        offer.lease_expires - time.time() - LEASE_MARGIN_S)
        handoff.outstanding += 1
        self.ctx.transfer.submit(TransferJob(
            offer.request_id, offer.kv_endpoint, offer.block_ids[first:last],
            handoff.local_blocks[first:last], time.monotonic() + max(remaining, 0.0),
            num_tokens=offer.num_cached_tokens - handoff.num_requested, final=offer.final))
        handoff.num_requested = offer.num_cached_tokens

    def on_result(self, result: TransferResult) -> None:
        handoff = self.active.get(result.request_id)
        if handoff is None:
            return
        handoff.outstanding -= 1
        if not result.ok and not handoff.failed:
            # never empty: an empty error would leave the hand-off open, its blocks held
            handoff.failed = result.error or f"transfer {result.status.value}"
            self.ctx.transfer.cancel(result.request_id)
        elif result.ok and result.final:
            handoff.complete = True
        self._maybe_close(handoff)

    def _maybe_close(self, handoff: HandOff) -> None:
        if handoff.outstanding > 0:
            return  # a job may still be writing into our blocks
        request_id = handoff.offer.request_id
        if handoff.aborted or handoff.failed:
            del self.active[request_id]
            self.ctx.transfer.forget(request_id)
            self.ctx.kv.free(request_id)
            if handoff.aborted:
                self._release_source(handoff, TransferStatus.ABORTED, "aborted")
            else:
                self._release_source(handoff, TransferStatus.FAILED, handoff.failed)
                self.failed.append((handoff.offer, f"KV transfer failed: {handoff.failed}"))
        elif handoff.complete:
            del self.active[request_id]
            self.ctx.transfer.forget(request_id)
            self._count_read(handoff)
            self.ctx.send(handoff.offer.source_inbox, KVTransferDone(request_id))
            self.ready.append(self._sequence(handoff))

    def _count_read(self, handoff: HandOff) -> None:
        """Counted when the KV is all here: what the prefill instance held at the end (the
        prompt, and a recovered request's output so far), not the prompt the offer began with,
        and a chunk-level block read again with the next chunk once."""
        held = -(-handoff.offer.num_cached_tokens // self.ctx.kv.block_size)
        read = held - handoff.num_skipped_blocks
        self.blocks_read += read
        self.ctx.count("transfer_blocks", read, kind="read")

    def _release_source(self, handoff: HandOff, status: TransferStatus, why: str) -> None:
        self.ctx.send(handoff.offer.source_inbox,
                      KVTransferDone(handoff.offer.request_id, status, why))

    def _sequence(self, handoff: HandOff) -> Sequence:
        offer = handoff.offer
        meta = SequenceMeta(reply_to=offer.reply_to, deadline=offer.deadline,
                            prediction=offer.prediction, first_prediction=offer.prediction)
        seq = Sequence(offer.request_id, offer.token_ids[:offer.num_prompt_tokens],
                       offer.sampling, self.ctx.runner.max_model_len, meta=meta)
        seq.token_ids = list(offer.token_ids)
        seq.num_computed_tokens = offer.num_cached_tokens
        return seq

    def take_ready(self) -> list[Sequence]:
        """Sequences whose KV has arrived, to join the running batch."""
        ready, self.ready = self.ready, []
        return ready

    def take_failed(self) -> list[tuple[KVTransferOffer, str]]:
        """Offers that ended without their KV, with the error to report to the gateway."""
        failed, self.failed = self.failed, []
        return failed

    # -- reporting -------------------------------------------------------------------------------
    def arriving_views(self) -> list[SeqView]:
        """Admitted sequences whose KV is still arriving, as the admission policy sees them."""
        return [SeqView(len(h.offer.token_ids), 0, h.offer.prediction)
                for h in self.active.values()]

    def waiting_offers(self) -> list[KVTransferOffer]:
        """Offers not admitted yet: they hold no local blocks."""
        return [h.offer for h in self.pending]

    def arriving_offers(self) -> list[KVTransferOffer]:
        """Admitted offers whose KV is being read (their local blocks are taken), bar those
        failed or aborted and waiting only for their last job to report back."""
        return [h.offer for h in self.active.values() if not (h.failed or h.aborted)]

    def seq_ids(self) -> set[str]:
        """Requests that own local blocks (their KV is being read into them)."""
        return set(self.active)

    @property
    def is_idle(self) -> bool:
        return not (self.pending or self.active)

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    @property
    def num_active(self) -> int:
        return len(self.active)

    def queued_tokens(self) -> int:
        return sum(h.offer.num_prompt_tokens for h in self.pending)
