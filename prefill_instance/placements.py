"""Placements this prefill instance has made that the cluster view does not show yet.

Why: a decode instance's numbers in the monitor's broadcast are one report interval (100 ms)
plus one broadcast old. Without this table a burst of hand-offs between two views would all see
the same picture and pile onto the instance that looked emptiest.

The scheme, which counts every placement exactly once:
- every offer carries a number (`KVTransferOffer.offer_number`) from one counter per prefill
  process: increasing across role flips and, seeded with the wall clock in microseconds, across
  restarts of an instance with the same id;
- a decode instance records, per prefill instance, the number of the last offer it received
  (`offers_seen`) and reports it in the same `InstanceStats` as its loads, and those loads count
  every offer it holds: waiting for admission, being read, decoding (decode_instance/role.py);
- offers from one prefill instance reach one decode instance in the order sent (one
  connection), so a report with `offers_seen[us] >= n` reflects every offer up to `n` we sent
  it. A placement therefore stays here, added to the view's numbers for its decode instance,
  until a view carrying such a report arrives; then the report counts it (or it already ended);
- it also leaves when it can never show in a report: the offer was refused (the instance is
  draining), its lease expired, the instance was declared dead, or a view no longer lists the
  instance (draining or gone: no candidate; it drains everything before it can come back);
- a view never moves a decode instance's picture backwards: an entry reported earlier
  (`report_time`) than the one already taken is replaced by that one (at a change of leading
  gateway the new leader's view may be a little older than the last).

What a placement adds to its decode instance's picture is what the instance's report will show
for it once it arrives there: one more sequence (heavy or light by its prediction) and, not free
any more, the blocks the decode instance takes on admission (the offer's tokens + 1).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import msgspec

from common.protocol import PeerInfo

_offer_numbers = itertools.count(time.time_ns() // 1000)


def next_offer_number() -> int:
    """The number of the next offer this process sends (strictly increasing)."""
    return next(_offer_numbers)


@dataclass(frozen=True)
class Placement:
    number: int  # the offer's number
    heavy: bool  # by the prediction the offer carried
    blocks: int  # what the decode instance takes on admission


class PendingPlacements:
    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id  # the key of our offers in a decode's `offers_seen`
        self.pending: dict[str, dict[str, Placement]] = {}  # decode id -> request id -> it
        self.latest: dict[str, PeerInfo] = {}  # decode id -> the newest report taken

    def placed(self, decode_id: str, request_id: str, placement: Placement) -> None:
        self.pending.setdefault(decode_id, {})[request_id] = placement

    def withdraw(self, request_id: str) -> None:
        """The offer can never show in a report (its lease ended here)."""
        for placements in self.pending.values():
            placements.pop(request_id, None)

    def forget(self, decode_id: str) -> None:
        self.pending.pop(decode_id, None)
        self.latest.pop(decode_id, None)

    def see(self, decodes: list[PeerInfo]) -> list[PeerInfo]:
        """Take a view's decode instances; returns them, each as its newest report."""
        listed: dict[str, PeerInfo] = {}
        latest, pending = self.latest, self.pending
        for peer in decodes:  # once per view per decode instance: kept lean
            name = peer.instance_id
            old = latest.get(name)
            if old is not None and old.report_time > peer.report_time:
                peer = old
            listed[name] = peer
            mine = pending.get(name)
            if mine:  # most views find nothing of ours unreported on most instances
                seen = peer.offers_seen.get(self.instance_id, 0)
                for request_id in [r for r, p in mine.items() if p.number <= seen]:
                    del mine[request_id]
        for gone in [k for k in (*pending, *latest) if k not in listed]:
            self.forget(gone)
        self.latest = listed
        return list(listed.values())

    def counts(self, decode_id: str) -> tuple[int, int, int]:
        """(sequences, of them heavy, blocks) placed on `decode_id` and not yet reported."""
        mine = self.pending.get(decode_id, {}).values()
        return len(mine), sum(p.heavy for p in mine), sum(p.blocks for p in mine)

    def adjusted(self, peer: PeerInfo) -> PeerInfo:
        """`peer` as it will report once our unreported placements on it arrive."""
        if not self.pending.get(peer.instance_id):  # the common case: a dispatch sees every peer
            return peer
        num, heavy, blocks = self.counts(peer.instance_id)
        return msgspec.structs.replace(
            peer, num_free_blocks=max(peer.num_free_blocks - blocks, 0),
            num_running=peer.num_running + num, num_heavy=peer.num_heavy + heavy,
            num_light=peer.num_light + num - heavy)
