"""The second KV tier as schedulers see it: host block ids, who holds them, and swap decisions.

Pure Python. A scheduler that preempts by swap moves a sequence's KV from its device blocks to
host blocks and later back; this module owns the host block ids (a `BlockPool` of its own) and
turns "swap sequence X out / in" into the (source block, destination block) pairs a `BatchPlan`
carries. The copies themselves are `common.engine.swap.HostSwapSpace`'s job, run by the model
runner before the plan's forward.

    swap out:  device table [d7 d2 d9]  --(d7,h0)(d2,h4)(d9,h1)-->  host table [h0 h4 h1]
    swap in:   host table   [h0 h4 h1]  --(h0,d3)(h4,d8)(h1,d5)-->  device table [d3 d8 d5]

NOTE: host blocks released by a swap-in stay owned until the plan has run (the scheduler calls
`release_deferred` when it absorbs the plan's output). Within one plan the runner copies every
swap-out before any swap-in, so a host block freed by a swap-in and handed to a swap-out of the
same plan would be overwritten before it was read. Device blocks need no such care: the
swap-outs run first, so a device block a swap-out frees can be the target of a swap-in or of the
forward in the same plan.
"""

from __future__ import annotations

from collections.abc import Iterable

from common.block_pool import BlockPool, BlockPoolError, KVCacheManager
from common.sequence import Sequence

BlockPairs = list[tuple[int, int]]


class SwapSpace:
    """Host block bookkeeping for one instance: a pool, per-sequence host tables, deferred frees."""

    def __init__(self, num_host_blocks: int) -> None:
        self.pool = BlockPool(num_host_blocks)
        self._tables: dict[str, list[int]] = {}
        self._deferred: list[int] = []  # released by a swap-in of the current plan
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_blocks_swapped = 0  # both directions, for reports

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def is_swapped(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def num_blocks_of(self, seq_id: str) -> int:
        """Host blocks holding the sequence's KV (0 when it is not swapped out)."""
        return len(self._tables.get(seq_id, ()))

    def can_swap_out(self, seq: Sequence, kv: KVCacheManager) -> bool:
        table = kv.table(seq.seq_id)
        return bool(table) and not self.is_swapped(seq.seq_id) \
            and len(table) <= self.pool.num_free_blocks

    def swap_out(self, seq: Sequence, kv: KVCacheManager) -> BlockPairs | None:
        """Give the sequence host blocks for all its device blocks and free the device blocks.

        Returns the (device, host) pairs to copy, or None (nothing changed) when the host tier
        is short or the sequence holds no device blocks."""
        if not self.can_swap_out(seq, kv):
            return None
        device = kv.table(seq.seq_id)
        host = self.pool.allocate(len(device))
        pairs = list(zip(device, host))
        self._tables[seq.seq_id] = host
        kv.free(seq.seq_id)
        self.num_swap_outs += 1
        self.num_blocks_swapped += len(pairs)
        return pairs

    def num_device_blocks_to_resume(self, seq: Sequence, kv: KVCacheManager,
                                    num_next_tokens: int) -> int:
        """Device blocks a swap-in plus a chunk of `num_next_tokens` tokens would take."""
        covered = max(seq.num_computed_tokens + num_next_tokens,
                      self.num_blocks_of(seq.seq_id) * kv.block_size)
        return kv.num_blocks_for(covered)

    def swap_in(self, seq: Sequence, kv: KVCacheManager) -> BlockPairs | None:
        """Give the sequence device blocks for its host blocks; the host blocks are released once
        the plan has run. Returns the (host, device) pairs, or None when the device pool is
        short or the sequence is not swapped out."""
        host = self._tables.get(seq.seq_id)
        if host is None or kv.table(seq.seq_id):
            return None
        device = kv.grow(seq.seq_id, len(host) * kv.block_size)
        if device is None:
            return None
        del self._tables[seq.seq_id]
        self._deferred.extend(host)
        self.num_swap_ins += 1
        self.num_blocks_swapped += len(host)
        return list(zip(host, device))

    def discard(self, seq_id: str) -> None:
        """Forget a finished or aborted sequence's host copy (its KV is not needed any more)."""
        host = self._tables.pop(seq_id, None)
        if host:
            self.pool.free(host)

    def release_deferred(self) -> None:
        """Free the host blocks of the last plan's swap-ins; call once that plan has run."""
        if self._deferred:
            self.pool.free(self._deferred)
            self._deferred = []

    def check_integrity(self, live_seq_ids: Iterable[str] | None = None) -> None:
        """Every used host block has exactly one holder: a swapped-out sequence or the deferred
        list; with `live_seq_ids`, every holder is live."""
        self.pool.check_integrity()
        held = [b for table in self._tables.values() for b in table] + self._deferred
        if len(held) != len(set(held)):
            raise BlockPoolError("a host block is held twice")
        if len(held) != self.pool.num_used_blocks:
            raise BlockPoolError(f"{self.pool.num_used_blocks} host blocks used, "
                                 f"{len(held)} held")
        if live_seq_ids is not None:
            dead = set(self._tables) - set(live_seq_ids)
            if dead:
                raise BlockPoolError(f"host blocks held by sequences that are not live: "
                                     f"{sorted(dead)[:3]}")
