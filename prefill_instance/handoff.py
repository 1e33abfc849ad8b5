"""Hand-offs from a prefill instance to decode instances: dispatch, leases, chunk notices.

A lease is the promise to keep a sequence's KV blocks until the decode instance has copied them
(KVTransferDone), or until the lease expires. Request-level: one KVTransferOffer when the prompt
is done. Chunk-level: the offer goes out after the first chunk (final=False), a KVChunkReady after
each further chunk, and a final KVChunkReady with the first token; each notice extends the lease.
A prefilled sequence no decode instance can take yet is held until the next offer.

The dispatcher sees a current picture: the last view (`see`) with this instance's own placements
that the view does not show yet added to it (prefill_instance/placements.py says when a
placement is in a view: exactly when that decode instance's report acknowledges the offer's
number). A view sent while the cluster is still starting (`complete` False) may lack decode
instances that are about to report: nothing is placed from it; sequences are held meanwhile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.engine.role import RoleContext
from common.protocol import AbortRequest, ClusterView, KVChunkReady, KVTransferOffer, PeerInfo
from common.sequence import Sequence
from prefill_instance.dispatcher import Dispatcher
from prefill_instance.placements import PendingPlacements, Placement, next_offer_number


@dataclass
class Lease:
    seq: Sequence
    decode: PeerInfo
    expires: float  # time.monotonic()


class Handoffs:
    def __init__(self, ctx: RoleContext, dispatcher: Dispatcher) -> None:
        self.ctx = ctx
        self.dispatcher = dispatcher
        self.lease_s = ctx.config.prefill.lease_timeout_s
        self.decodes: list[PeerInfo] = []
        self.leases: dict[str, Lease] = {}
        self.undispatched: list[Sequence] = []  # prefilled, waiting for a decode instance
        self.placements = PendingPlacements(ctx.instance_id)

    def see(self, view: ClusterView) -> list[str]:
        """Take the cluster monitor's broadcast: the decode instances to offer to from now on.
        Leases to instances it reports dead are void; returns their request ids."""
        decodes = self.placements.see(view.decodes)
        self.decodes = decodes if view.complete else []
        return [request_id for dead in view.dead for request_id in self.void_to(dead)]

    # -- sequences waiting for a decode instance -------------------------------------------------
    def hold(self, seq: Sequence) -> None:
        self.undispatched.append(seq)

    def take_held(self) -> list[Sequence]:
        held, self.undispatched = self.undispatched, []
        return held

    def drop_held(self, request_id: str) -> None:
        self.undispatched = [s for s in self.undispatched if s.seq_id != request_id]

    # -- leases ----------------------------------------------------------------------------------
    def has_lease(self, request_id: str) -> bool:
        return request_id in self.leases

    @property
    def num_transferring(self) -> int:
        """Sequences handed off or waiting to be: their blocks are still held here."""
        return len(self.leases) + len(self.undispatched)

    def seq_ids(self) -> set[str]:
        return set(self.leases) | {s.seq_id for s in self.undispatched}

    def offer(self, seq: Sequence, final: bool) -> PeerInfo | None:
        """Pick a decode instance and offer it the sequence's blocks; None if none is known."""
        decode = self.dispatcher.pick(seq, [self.placements.adjusted(d) for d in self.decodes])
        if decode is None:
            return None
        self.leases[seq.seq_id] = Lease(seq, decode, time.monotonic() + self.lease_s)
        number = next_offer_number()
        options = self.dispatcher.options
        self.placements.placed(decode.instance_id, seq.seq_id, Placement(
            number, options.prediction.is_heavy(seq.meta.prediction),
            -(-(seq.num_tokens + 1) // options.block_size)))  # as the receiver's admission
        self.ctx.send(decode.inbox, KVTransferOffer(
            request_id=seq.seq_id, token_ids=list(seq.token_ids),
            num_prompt_tokens=seq.num_prompt_tokens, sampling=seq.sampling,
            reply_to=seq.meta.reply_to, source_instance=self.ctx.instance_id,
            source_inbox=self.ctx.inbox_address, kv_endpoint=self.ctx.transfer.endpoint,
            block_ids=list(self.ctx.kv.table(seq.seq_id)),
            num_cached_tokens=seq.num_computed_tokens, lease_expires=time.time() + self.lease_s,
            arrival_time=seq.meta.arrival_wall, deadline=seq.meta.deadline, final=final,
            prediction=seq.meta.prediction, offer_number=number,
            block_hashes=self.ctx.kv.block_hashes(seq.seq_id)))
        return decode

    def notify(self, seq: Sequence, final: bool) -> None:
        """Chunk-level: more of the sequence's KV is ready (final: the prompt is done)."""
        lease = self.leases[seq.seq_id]
        lease.expires = time.monotonic() + self.lease_s
        self.ctx.send(lease.decode.inbox, KVChunkReady(
            seq.seq_id, list(self.ctx.kv.table(seq.seq_id)), seq.num_computed_tokens, final,
            list(seq.token_ids) if final else [], lease_expires=time.time() + self.lease_s,
            prediction=seq.meta.prediction))

    def release(self, request_id: str) -> Lease | None:
        return self.leases.pop(request_id, None)

    def forward_abort(self, request_id: str, reason: str) -> None:
        lease = self.leases.pop(request_id, None)
        if lease is not None:  # after the offer on the same connection: it cannot overtake it
            self.ctx.send(lease.decode.inbox, AbortRequest(request_id, reason))

    def void_to(self, instance_id: str) -> list[str]:
        """A decode instance died: its leases are void. Returns their request ids."""
        void = [r for r, lease in self.leases.items() if lease.decode.instance_id == instance_id]
        for request_id in void:
            del self.leases[request_id]
        self.placements.forget(instance_id)
        return void

    def exclude(self, instance_id: str) -> None:
        """Stop offering to an instance until the next broadcast lists it again. It refused an
        offer, being about to flip: none of our offers will count there."""
        self.decodes = [d for d in self.decodes if d.instance_id != instance_id]
        self.placements.forget(instance_id)

    def expired(self) -> list[Lease]:
        now = time.monotonic()
        gone = [lease for lease in self.leases.values() if now > lease.expires]
        for lease in gone:
            del self.leases[lease.seq.seq_id]
            self.placements.withdraw(lease.seq.seq_id)  # the decode instance drops it too
        return gone
