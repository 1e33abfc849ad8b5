"""The decode role: offer -> allocate -> read KV -> confirm -> decode -> stream -> free.

1. Offer: a KVTransferOffer from a prefill instance waits in the receiver's queue.
2. Allocate and read (decode_instance/receiver.py): when the pool has room (greedy admission, as
   vLLM admits), blocks are taken and the prefill instance's blocks are read into them, once
   (request-level) or chunk by chunk as they are prefilled (chunk-level).
3. Confirm: when the last read lands, KVTransferDone tells the prefill instance to free its copy
   and the sequence joins the running batch; a failed read frees our blocks, releases the
   prefill's lease, and ends the request with an error event (recoverable when the transfer
   failure policy is `recompute`: the gateway then runs the prefill again elsewhere).
4. Decode: continuous batching, one token per running sequence per forward, each token streamed
   to the request's gateway; blocks are freed when the sequence ends or is aborted.

The load report counts, beside the running sequences, every offer held and not decoding yet
(waiting or being read, heavy or light by its prediction), the blocks the waiting ones will take,
and the number of the last offer received from each prefill instance, all as of the same moment:
a prefill instance stops adding its own unreported placements here exactly when a report shows
their numbers (prefill_instance/placements.py).
"""

from __future__ import annotations

import logging
import time

from common.engine.role import Role, RoleContext
from common.engine.swap import attach_host_tier
from common.plan import BatchPlan, ModelOutput
from common.protocol import (
    AbortRequest,
    ClusterView,
    GenerateRequest,
    KVChunkReady,
    KVTransferDone,
    KVTransferOffer,
    LengthPrediction,
    Message,
)
from common.schedulers.swapping import SwapSpace
from common.transfer import TransferStatus
from decode_instance.admission import SeqView, make_admission
from decode_instance.receiver import Receiver
from decode_instance.scheduler import DecodeScheduler

log = logging.getLogger(__name__)
RECENT_ABORT_S = 60.0


class DecodeRole(Role):
    name = "decode"
    scheduler: DecodeScheduler

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.config = ctx.config.decode
        self.scheduler = DecodeScheduler(ctx.config.engine.batch, ctx.kv, self._swap_space())
        self.prediction = ctx.config.prediction
        self.admission = make_admission(self.config.admission, self.prediction)
        self.receiver = Receiver(ctx, self._admits)
        self.recoverable = ctx.config.transfer.failure_policy == "recompute"
        self.finished = {"heavy": 0, "light": 0}
        self.first_admit_time = self.last_finish_time = 0.0
        self.offers_seen: dict[str, int] = {}  # prefill instance -> its last offer's number
        self.num_local_prefills = 0  # requests prefilled here (conditional disaggregation)
        # Aborts can overtake their offer (they come from the gateway, offers from a prefill
        # instance): remember recent ones so a late offer is refused, not decoded for nobody.
        self.recent_aborts: dict[str, float] = {}

    # -- messages ------------------------------------------------------------------------------
    def handle(self, message: Message) -> None:
        if isinstance(message, KVTransferOffer):
            self._offer(message)
        elif isinstance(message, KVChunkReady):
            self.receiver.chunk(message)
        elif isinstance(message, AbortRequest):
            self._abort(message.request_id)
        elif isinstance(message, ClusterView):
            for dead in message.dead:
                self.receiver.fail_from(dead)
        elif isinstance(message, GenerateRequest):
            self._prefill_locally(message)

    def _prefill_locally(self, request: GenerateRequest) -> None:
        """Conditional disaggregation: the gateway found the prompt's uncached part short
        enough for this instance to prefill it between decode steps (mostly a later turn whose
        history is in our prefix cache). The sequence waits in the decode scheduler's queue and
        is prefilled in chunks under the token budget, as a recomputed one would be."""
        if not request.local_prefill or self.draining:  # e.g. arrived after a flip
            self.fail_request(request.reply_to, request.request_id, "not a prefill instance",
                              recoverable=True)
            return
        seq = self.sequence_for(request)
        if self.fits_or_fail(seq):
            self.admit_guided(seq, self.scheduler.add)
            self.num_local_prefills += 1
            self.first_admit_time = self.first_admit_time or time.time()

    def _swap_space(self) -> SwapSpace | None:
        if self.config.preempt != "swap":
            return None
        num_host_blocks = self.config.swap_blocks or self.ctx.kv.num_blocks
        attach_host_tier(self.ctx.runner, num_host_blocks, self.config.swap_bandwidth)
        return SwapSpace(num_host_blocks)

    def _admits(self, offer: KVTransferOffer) -> bool:
        new = SeqView(len(offer.token_ids) + (0 if offer.final else 1),
                      len(offer.token_ids) - offer.num_prompt_tokens, offer.prediction)
        # admitted ones whose KV is still arriving count as running
        running = self.scheduler.running_views() + self.receiver.arriving_views()
        kv = self.ctx.kv
        return self.admission.admits(new, running, kv.num_free_blocks, kv.num_blocks,
                                     kv.block_size)

    def _offer(self, offer: KVTransferOffer) -> None:
        # Received, whatever becomes of it: from the next report on, our numbers show it.
        source = offer.source_instance
        self.offers_seen[source] = max(self.offers_seen.get(source, 0), offer.offer_number)
        if offer.request_id in self.recent_aborts:
            self.ctx.send(offer.source_inbox,
                          KVTransferDone(offer.request_id, TransferStatus.ABORTED, "aborted"))
        elif self.draining:
            self.ctx.send(offer.source_inbox, KVTransferDone.rejected(offer.request_id, "draining"))
        else:
            self.prepare_guided(offer.sampling)  # compiles while the KV is read
            self.receiver.offer(offer)

    def _abort(self, request_id: str) -> None:
        now = time.monotonic()
        self.recent_aborts[request_id] = now
        for old in [k for k, t in self.recent_aborts.items() if now - t > RECENT_ABORT_S]:
            del self.recent_aborts[old]
        self.receiver.abort(request_id)
        self.scheduler.abort(request_id)
        self.drop_compiling(request_id)

    def begin_drain(self) -> None:
        super().begin_drain()
        self.receiver.reject_pending("draining")  # not started: offered elsewhere
        self._migrate_held()

    def _migrate_held(self) -> None:
        """`flip_drain` migrate: every sequence held here (decoding, waiting, swapped out, or
        admitted after the drain began because its KV was already on the way) ends with a
        recoverable error, and its gateway runs it again elsewhere from the prompt and the
        tokens generated so far: recompute migration, no KV is copied. The drain then takes one
        forward instead of the longest remaining output."""
        if not (self.draining and self.config.flip_drain == "migrate"):
            return
        for seq in list(self.scheduler.sequences.values()):
            self.discard(seq.seq_id, "migrating")
            self.fail(seq, "instance is flipping to prefill: run again elsewhere",
                      recoverable=True)
            self.num_migrated += 1

    # -- receiving -----------------------------------------------------------------------------
    def poll(self) -> None:
        for result in self.ctx.transfer.poll():
            self.receiver.on_result(result)
        self.receiver.admit()
        for seq in self.receiver.take_ready():
            self.admit_guided(seq, self.scheduler.add_prefilled)
            self.first_admit_time = self.first_admit_time or time.time()
        for offer, error in self.receiver.take_failed():
            self.fail_request(offer.reply_to, offer.request_id, error,
                              recoverable=self.recoverable,
                              num_prompt_tokens=offer.num_prompt_tokens)
        self._migrate_held()  # those whose KV arrived after the drain began
        self.expire_deadlines()

    # -- forwards ------------------------------------------------------------------------------
    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> None:
        for seq, update in self.stream(plan, output):
            if update.finish_reason in ("stop", "length"):
                self._finished(seq.meta.first_prediction, update.num_output_tokens)

    def _finished(self, prediction: LengthPrediction | None, num_output_tokens: int) -> None:
        self.last_finish_time = time.time()
        self.finished["heavy" if self.prediction.is_heavy(prediction) else "light"] += 1
        if prediction is not None:
            self._score(prediction, num_output_tokens)

    def _score(self, prediction: LengthPrediction, num_output_tokens: int) -> None:
        """Predictor accuracy against the realized length, for /metrics."""
        width = max(prediction.upper - prediction.lower, 1)
        miss = abs(num_output_tokens // width - prediction.bucket)
        outcome = "exact" if miss == 0 else "within_one" if miss == 1 else "miss"
        self.ctx.count("predictions", outcome=outcome)

    # -- reporting -----------------------------------------------------------------------------
    def load(self) -> dict:
        heavy = sum(1 for view in self.scheduler.running_views()
                    if self.prediction.is_heavy(view.prediction))
        return {"num_waiting": self.receiver.num_pending,
                "num_running": self.scheduler.num_running,
                "num_transferring": self.receiver.num_active,
                # offers waiting, and prompts (local prefills, recomputes) still to compute here
                "num_queued_tokens": self.receiver.queued_tokens()
                + self.scheduler.num_queued_tokens,
                "num_heavy_decodes": heavy,
                "num_light_decodes": self.scheduler.num_running - heavy,
                "num_preemptions": self.scheduler.num_preemptions,
                "policy_counters": self.scheduler.counters(),
                "num_finished_heavy": self.finished["heavy"],
                "num_finished_light": self.finished["light"],
                "first_admit_time": self.first_admit_time,
                "last_finish_time": self.last_finish_time,
                "kv_blocks_read": self.receiver.blocks_read,
                "kv_blocks_skipped": self.receiver.blocks_skipped,
                "num_local_prefills": self.num_local_prefills,
                **self._incoming()}

    def _incoming(self) -> dict:
        """Offers held and not decoding yet, as the dispatchers must see them."""
        waiting = self.receiver.waiting_offers()
        incoming = waiting + self.receiver.arriving_offers()
        heavy = sum(1 for offer in incoming if self.prediction.is_heavy(offer.prediction))
        # what admission takes (receiver.admit: the offer's tokens + the next one)
        reserved = sum(self.ctx.kv.num_blocks_for(len(offer.token_ids) + 1) for offer in waiting)
        return {"num_incoming_heavy": heavy, "num_incoming_light": len(incoming) - heavy,
                "num_reserved_blocks": reserved, "offers_seen": dict(self.offers_seen)}

    def live_seq_ids(self) -> set[str]:
        return super().live_seq_ids() | self.receiver.seq_ids()

    @property
    def is_drained(self) -> bool:
        return self.receiver.is_idle and not self.scheduler.has_work and not self.compiling

    @property
    def wait_s(self) -> float:
        return 0.001 if self.receiver.num_active else super().wait_s
