"""KV block bookkeeping, pure Python: the block pool and the per-sequence block tables.

`BlockPool` owns every block id: a FIFO free list and a reference count per block. A block is free
exactly when its count is zero. `KVCacheManager` sits on top and is what schedulers talk to: it
grows a sequence's block table as its chunks are scheduled and frees the table when the sequence
ends. Block tables are append-only; freeing returns tail blocks first. The manager keeps the only
copy of each table (`Sequence.block_ids` reads it from here).

    table(seq_id):  [ b7 | b2 | b9 ]       block_size = 4, num_computed_tokens = 10
    tokens:         [0..3][4..7][8,9,_,_]  the last block has 2 free slots

`check_integrity()` proves the invariants; tests and idle instances call it.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class BlockPoolError(RuntimeError):
    """A bookkeeping invariant was violated (double free, leak, unknown block)."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh blocks with count 1, or None (and nothing taken) if too few free."""
        if num_blocks > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def fork(self, block_ids: Iterable[int]) -> None:
        """Share blocks: one more reference each (for a second owner of the same KV)."""
        block_ids = list(block_ids)
        for block in block_ids:
            if self._ref_counts[block] <= 0:
                raise BlockPoolError(f"cannot share free block {block}")
        for block in block_ids:
            self._ref_counts[block] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go back to the free list."""
        block_ids = list(block_ids)
        drops = Counter(block_ids)
        for block, count in drops.items():
            if not 0 <= block < self.num_blocks:
                raise BlockPoolError(f"unknown block {block}")
            if self._ref_counts[block] < count:
                raise BlockPoolError(f"double free of block {block}")
        for block in reversed(block_ids):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockPoolError("a block appears twice in the free list")
        for block, count in enumerate(self._ref_counts):
            if count < 0:
                raise BlockPoolError(f"block {block} has negative count {count}")
            if (count == 0) != (block in free):
                raise BlockPoolError(f"block {block} has count {count} but is "
                                     f"{'' if block in free else 'not '}in the free list")


class KVCacheManager:
    """Per-sequence block tables over a `BlockPool`; the only KV API schedulers use."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def owners(self) -> list[str]:
        return list(self._tables)

    def num_new_blocks(self, seq_id: str, num_tokens_total: int) -> int:
        """Blocks to add so the sequence's table covers `num_tokens_total` tokens."""
        return max(0, self.num_blocks_for(num_tokens_total) - len(self.table(seq_id)))

    def can_grow(self, seq_id: str, num_tokens_total: int, reserve: int = 0) -> bool:
        return self.num_new_blocks(seq_id, num_tokens_total) + reserve <= self.num_free_blocks

    def grow(self, seq_id: str, num_tokens_total: int) -> list[int] | None:
        """Extend (or create) the table to cover `num_tokens_total` tokens. Returns the table, or
        None, with nothing allocated, when the pool is short."""
        needed = self.num_new_blocks(seq_id, num_tokens_total)
        new_blocks = self.pool.allocate(needed)
        if new_blocks is None:
            return None
        table = self._tables.setdefault(seq_id, [])
        table.extend(new_blocks)
        return table

    def fork(self, seq_id: str, new_seq_id: str) -> list[int]:
        """Give `new_seq_id` a table sharing every block of `seq_id` (copy-free, counted)."""
        if new_seq_id in self._tables:
            raise BlockPoolError(f"sequence {new_seq_id!r} already has blocks")
        table = self.table(seq_id)
        self.pool.fork(table)
        self._tables[new_seq_id] = list(table)
        return self._tables[new_seq_id]

    def free(self, seq_id: str) -> int:
        """Release every block of the sequence (tail first). Returns how many were released."""
        table = self._tables.pop(seq_id, None)
        if not table:
            return 0
        self.pool.free(table)
        return len(table)

    def check_integrity(self, live_seq_ids: Iterable[str] | None = None) -> None:
        """Pool invariants, plus: every used block is owned, and owned only by live sequences."""
        self.pool.check_integrity()
        owned = Counter(block for table in self._tables.values() for block in table)
        for block in range(self.pool.num_blocks):
            if owned.get(block, 0) != self.pool.ref_count(block):
                raise BlockPoolError(f"block {block} has count {self.pool.ref_count(block)} but "
                                     f"{owned.get(block, 0)} owners")
        if live_seq_ids is not None:
            dead = set(self._tables) - set(live_seq_ids)
            if dead:
                raise BlockPoolError(f"blocks held by {len(dead)} sequences that are not live, "
                                     f"e.g. {sorted(dead)[:3]}")
