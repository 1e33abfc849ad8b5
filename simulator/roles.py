"""The simulated roles: the glue of prefill_instance/role.py, decode_instance/role.py and
coupled_instance/role.py around the REAL scheduler and policy objects (simulator.policies).

What is the serving code's own, unchanged: every scheduler (`schedule()`, `update_from_output`),
the prefill sort key, the dispatcher and its placement table (`PendingPlacements`, offer
numbers), the length predictor's oracle, the decode admission policy, the co-located policies,
and the block pool under all of them. What is re-written here, line for line where it matters
(each method names its original): turning messages into sequences, the hand-off (offer, lease,
KVTransferDone), the decode receiver's admission loop, and the load reports. The roles' own
classes are not driven directly because they read the wall clock (leases, deadlines) and the
decode and coupled roles load torch.

Messages (`handle(kind, payload)`): "generate" (SimRequest, prompt ids, local prefill?),
"offer" (KVTransferOffer), "received" (an offer whose KV has arrived), "done"
(KVTransferDone), "view" (ClusterView).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from common.plan import BatchPlan, ModelOutput
from common.protocol import KVTransferDone, KVTransferOffer, PeerInfo
from common.sequence import Sequence, SequenceMeta
from common.transfer import TransferStatus
from decode_instance.admission import SeqView
from prefill_instance.placements import PendingPlacements, Placement, next_offer_number
from simulator import policies

if TYPE_CHECKING:
    from simulator.instances import SimInstance


class SimRole:
    name = "?"

    def __init__(self, inst: SimInstance) -> None:
        self.inst, self.cluster = inst, inst.cluster
        self.draining = False
        self.scheduler = None

    def handle(self, kind: str, payload) -> None:
        raise NotImplementedError

    def poll(self) -> None:
        """Background work between forwards."""

    def schedule(self) -> BatchPlan:
        return self.scheduler.schedule()

    def absorb(self, plan: BatchPlan, output: ModelOutput) -> None:
        for update in self.scheduler.update_from_output(plan, output):
            self.cluster.on_token(update.seq_id, update.finish_reason)

    def begin_drain(self) -> None:
        self.draining = True

    @property
    def is_drained(self) -> bool:
        return not self.scheduler.has_work

    def live_seq_ids(self) -> set[str]:
        return self.scheduler.seq_ids()

    # -- common/engine/role.py -----------------------------------------------------------------
    def sequence_for(self, request, prompt_ids: list[int]) -> Sequence:
        """Role.sequence_for; arrival_time is the simulated clock (the sort keys read it). A
        request run again after a migration resumes with the tokens its gateway already has
        counted as output (`prompt_ids` ends with them)."""
        num_generated = len(self.cluster.traces[request.request_id].token_times)
        seq = Sequence(request.request_id, prompt_ids[:len(prompt_ids) - num_generated],
                       self.cluster.sampling(request), self.inst.max_model_len,
                       arrival_time=self.inst.loop.now,
                       meta=SequenceMeta(arrival_wall=request.arrival_s))
        seq.token_ids = list(prompt_ids)
        return seq

    def fits_or_fail(self, seq: Sequence) -> bool:
        kv = self.inst.kv
        if kv.num_blocks_for(seq.num_tokens + 1) <= kv.num_blocks:
            return True
        self.cluster.fail(seq.seq_id, "the prompt needs more KV blocks than this instance has")
        return False

    def refuse_offer(self, offer: KVTransferOffer) -> None:
        self.cluster.send(offer.source_instance, "done", KVTransferDone.rejected(
            offer.request_id, "not a decode instance"))


class SimPrefill(SimRole):
    """prefill_instance/role.py with request-level hand-offs (prefill_instance/handoff.py)."""

    name = "prefill"

    def __init__(self, inst: SimInstance) -> None:
        super().__init__(inst)
        config = inst.config
        chunk = policies.chunk_size(config, inst.costs)
        self.scheduler = policies.prefill_scheduler(config, chunk, inst.kv)
        self.dispatcher = policies.dispatcher(config, inst.kv.block_size, inst.seed)
        self.predictor = policies.predictor(config)
        self.placements = PendingPlacements(inst.instance_id)
        self.decodes: list[PeerInfo] = []
        self.leases: dict[str, tuple[Sequence, str]] = {}  # request -> (sequence, decode id)
        self.held: list[Sequence] = []  # prefilled, no decode instance to take them yet

    def handle(self, kind, payload) -> None:
        if kind == "generate":  # PrefillRole._admit (a local-prefill flag changes nothing)
            request, prompt_ids, _ = payload
            seq = self.sequence_for(request, prompt_ids)
            if self.fits_or_fail(seq):
                self.predictor.admit(seq)
                self.scheduler.add(seq)
        elif kind == "view":
            self.decodes = self.placements.see(payload.decodes)  # Handoffs.see
        elif kind == "done":
            self._transfer_done(payload)
        elif kind == "offer":
            self.refuse_offer(payload)

    def _transfer_done(self, done: KVTransferDone) -> None:
        """PrefillRole._transfer_done (request-level: the prompt is always done here)."""
        lease = self.leases.pop(done.request_id, None)
        if lease is None:
            return
        seq, decode_id = lease
        if done.status is TransferStatus.REJECTED:  # Handoffs.exclude, then hold
            self.decodes = [d for d in self.decodes if d.instance_id != decode_id]
            self.placements.forget(decode_id)
            self.held.append(seq)
            return
        self.inst.kv.free(done.request_id)

    def poll(self) -> None:
        held, self.held = self.held, []
        for seq in held:
            self._dispatch(seq)

    def schedule(self) -> BatchPlan:
        return self.predictor.prepare(self.scheduler.schedule())

    def absorb(self, plan: BatchPlan, output: ModelOutput) -> None:
        """PrefillRole.update_from_output: first tokens out, prefilled sequences handed off."""
        updates = self.scheduler.update_from_output(plan, output)
        for update in updates:
            self.cluster.on_token(update.seq_id, update.finish_reason)
        for seq in self.scheduler.take_prefilled():
            self.predictor.ensure(seq)
            self._dispatch(seq)

    def _dispatch(self, seq: Sequence) -> None:
        """Handoffs.offer: the dispatcher's pick over the view plus our unreported placements;
        the blocks stay here under a lease until the decode instance has read them."""
        decode = self.dispatcher.pick(seq, [self.placements.adjusted(d) for d in self.decodes])
        if decode is None:
            self.held.append(seq)
            return
        number = next_offer_number()
        options = self.dispatcher.options
        self.placements.placed(decode.instance_id, seq.seq_id, Placement(
            number, options.prediction.is_heavy(seq.meta.prediction),
            -(-(seq.num_tokens + 1) // options.block_size)))
        self.leases[seq.seq_id] = (seq, decode.instance_id)
        self.cluster.send(decode.instance_id, "offer", KVTransferOffer(
            request_id=seq.seq_id, token_ids=list(seq.token_ids),
            num_prompt_tokens=seq.num_prompt_tokens, sampling=seq.sampling, reply_to="",
            source_instance=self.inst.instance_id, source_inbox=self.inst.instance_id,
            kv_endpoint=self.inst.instance_id, block_ids=[],
            num_cached_tokens=seq.num_computed_tokens, lease_expires=0.0,
            arrival_time=seq.meta.arrival_wall, prediction=seq.meta.prediction,
            offer_number=number, block_hashes=self.inst.kv.block_hashes(seq.seq_id)))

    def load(self) -> dict:
        """PrefillRole.load."""
        return {"num_waiting": self.scheduler.num_waiting,
                "num_running": self.scheduler.num_running,
                "num_transferring": len(self.leases) + len(self.held),
                "num_queued_tokens": self.scheduler.num_queued_tokens}

    @property
    def is_drained(self) -> bool:
        return not (self.scheduler.sequences or self.leases or self.held)

    def live_seq_ids(self) -> set[str]:
        return self.scheduler.seq_ids() | set(self.leases) | {s.seq_id for s in self.held}


class SimDecode(SimRole):
    """decode_instance/role.py with its receiver (decode_instance/receiver.py), request-level."""

    name = "decode"

    def __init__(self, inst: SimInstance) -> None:
        super().__init__(inst)
        config = inst.config
        self.scheduler = policies.decode_scheduler(config, inst.kv)
        self.prediction = config.prediction
        self.admission = policies.admission(config)
        self.pending: deque[KVTransferOffer] = deque()  # waiting for admission, in order
        self.arriving: dict[str, KVTransferOffer] = {}  # admitted, KV on the link
        self.offers_seen: dict[str, int] = {}
        self.finished = {"heavy": 0, "light": 0}
        self.num_local_prefills = 0

    def handle(self, kind, payload) -> None:
        if kind == "offer":
            self._offer(payload)
        elif kind == "received":
            self._received(payload)
        elif kind == "generate":  # conditional disaggregation: DecodeRole._prefill_locally
            request, prompt_ids, local = payload
            if not local or self.draining:
                self.cluster.refused(self.inst, payload)
                return
            seq = self.sequence_for(request, prompt_ids)
            if self.fits_or_fail(seq):
                self.scheduler.add(seq)
                self.num_local_prefills += 1

    def _offer(self, offer: KVTransferOffer) -> None:
        """DecodeRole._offer."""
        source = offer.source_instance
        self.offers_seen[source] = max(self.offers_seen.get(source, 0), offer.offer_number)
        if self.draining:
            self.cluster.send(source, "done", KVTransferDone.rejected(offer.request_id,
                                                                      "draining"))
        else:
            self.pending.append(offer)

    def begin_drain(self) -> None:
        """DecodeRole.begin_drain: offers not started go back, to be offered elsewhere; with
        flip_drain migrate, the held sequences go back to the gateway at the next turn (the
        real instance handles its FlipCommand between forwards)."""
        super().begin_drain()
        while self.pending:
            offer = self.pending.popleft()
            self.cluster.send(offer.source_instance, "done",
                              KVTransferDone.rejected(offer.request_id, "draining"))

    def _migrate_held(self) -> None:
        """DecodeRole._migrate_held: every held sequence runs again elsewhere from its prompt
        and generated tokens."""
        if not (self.draining and self.inst.config.decode.flip_drain == "migrate"):
            return
        for seq in list(self.scheduler.sequences.values()):
            self.scheduler.abort(seq.seq_id)
            self.cluster.migrate(self.inst, seq)

    def _admits(self, offer: KVTransferOffer) -> bool:
        """DecodeRole._admits (request-level offers are final)."""
        new = SeqView(len(offer.token_ids), len(offer.token_ids) - offer.num_prompt_tokens,
                      offer.prediction)
        running = self.scheduler.running_views() + [
            SeqView(len(o.token_ids), 0, o.prediction) for o in self.arriving.values()]
        kv = self.inst.kv
        return self.admission.admits(new, running, kv.num_free_blocks, kv.num_blocks,
                                     kv.block_size)

    def poll(self) -> None:
        """Receiver.admit: in arrival order, while the policy admits and blocks are there;
        the cached prefix (if any) is not read; the rest goes over the link."""
        self._migrate_held()
        kv = self.inst.kv
        while self.pending:
            offer = self.pending[0]
            if not self._admits(offer):
                return
            request_id = offer.request_id
            have = kv.claim_prefix(request_id, offer.token_ids, offer.num_prompt_tokens,
                                   known=offer.block_hashes)
            if kv.grow(request_id, len(offer.token_ids) + 1) is None:
                kv.free(request_id)
                return
            self.pending.popleft()
            self.arriving[request_id] = offer
            self.cluster.start_transfer(self.inst, offer, offer.num_cached_tokens - have)

    def _received(self, offer: KVTransferOffer) -> None:
        """Receiver._maybe_close + _sequence: the prefill frees its copy, the sequence decodes."""
        del self.arriving[offer.request_id]
        self.cluster.send(offer.source_instance, "done", KVTransferDone(offer.request_id))
        meta = SequenceMeta(prediction=offer.prediction, first_prediction=offer.prediction)
        seq = Sequence(offer.request_id, offer.token_ids[:offer.num_prompt_tokens],
                       offer.sampling, self.inst.max_model_len, arrival_time=self.inst.loop.now,
                       meta=meta)
        seq.token_ids = list(offer.token_ids)
        seq.num_computed_tokens = offer.num_cached_tokens
        self.scheduler.add_prefilled(seq)

    def absorb(self, plan: BatchPlan, output: ModelOutput) -> None:
        """DecodeRole.update_from_output (the finished count by prediction feeds the reports)."""
        held = self.scheduler.sequences_in(plan)
        for update in self.scheduler.update_from_output(plan, output):
            self.cluster.on_token(update.seq_id, update.finish_reason)
            if update.finish_reason in ("stop", "length"):
                heavy = self.prediction.is_heavy(held[update.seq_id].meta.first_prediction)
                self.finished["heavy" if heavy else "light"] += 1

    def load(self) -> dict:
        """DecodeRole.load and _incoming: what the dispatchers see of this instance."""
        views = self.scheduler.running_views()
        heavy = sum(1 for view in views if self.prediction.is_heavy(view.prediction))
        incoming = [*self.pending, *self.arriving.values()]
        incoming_heavy = sum(1 for o in incoming if self.prediction.is_heavy(o.prediction))
        kv = self.inst.kv
        return {"num_waiting": len(self.pending), "num_running": self.scheduler.num_running,
                "num_transferring": len(self.arriving),
                "num_queued_tokens": sum(o.num_prompt_tokens for o in self.pending)
                + self.scheduler.num_queued_tokens,
                "num_heavy_decodes": heavy, "num_light_decodes": len(views) - heavy,
                "num_preemptions": self.scheduler.num_preemptions,
                "policy_counters": self.scheduler.counters(),
                "num_finished_heavy": self.finished["heavy"],
                "num_finished_light": self.finished["light"],
                "num_local_prefills": self.num_local_prefills,
                "num_incoming_heavy": incoming_heavy,
                "num_incoming_light": len(incoming) - incoming_heavy,
                "num_reserved_blocks": sum(kv.num_blocks_for(len(o.token_ids) + 1)
                                           for o in self.pending),
                "offers_seen": dict(self.offers_seen)}

    @property
    def is_drained(self) -> bool:
        return not (self.pending or self.arriving or self.scheduler.has_work)

    def live_seq_ids(self) -> set[str]:
        return self.scheduler.seq_ids() | set(self.arriving)


class SimCoupled(SimRole):
    """coupled_instance/role.py: one instance serves requests end to end with its policy."""

    name = "coupled"

    def __init__(self, inst: SimInstance) -> None:
        super().__init__(inst)
        self.scheduler = policies.coupled_scheduler(inst.config, inst.kv, inst.costs,
                                                    inst.loop.clock)

    def handle(self, kind, payload) -> None:
        if kind == "generate":
            request, prompt_ids, _ = payload
            if self.draining:
                self.cluster.refused(self.inst, payload)
                return
            seq = self.sequence_for(request, prompt_ids)
            if self.fits_or_fail(seq):
                self.scheduler.add(seq)
        elif kind == "offer":
            self.refuse_offer(payload)

    def load(self) -> dict:
        """CoupledRole.load."""
        return {"num_waiting": self.scheduler.num_waiting,
                "num_running": self.scheduler.num_running, "num_transferring": 0,
                "num_queued_tokens": self.scheduler.num_queued_tokens,
                "policy_counters": self.scheduler.counters()}


ROLES = {"prefill": SimPrefill, "decode": SimDecode, "coupled": SimCoupled}
