"""KV block bookkeeping, pure Python: the block pool, its prefix cache, and per-sequence tables.

`BlockPool` owns every block id: a reference count per block and a free queue of the blocks with
count zero. A block is free exactly when its count is zero. `KVCacheManager` sits on top and is
what schedulers talk to: it grows a sequence's block table as its chunks are scheduled and frees
the table when the sequence ends. Block tables are append-only; freeing returns tail blocks
first. The manager keeps the only copy of each table (`Sequence.block_ids` reads it from here).

    table(seq_id):  [ b7 | b2 | b9 ]       block_size = 4, num_computed_tokens = 10
    tokens:         [0..3][4..7][8,9,_,_]  the last block has 2 free slots

Prefix cache (vLLM's automatic prefix caching; instances turn it on from `CacheConfig`, tools
that measure compute leave it off): a block full of computed
KV is registered under a chained hash of its tokens, `hash(parent block's hash, its tokens)`, so
equal hashes mean equal tokens at equal positions from the sequence's start. A new sequence
shares (reference count + 1) the cached blocks of its longest cached prefix and computes only the
rest. A block whose last owner lets go stays cached in the free queue: uncached blocks are taken
first, then cached ones, least recently released first (LRU eviction), and taking a cached block
evicts its hash. Only full blocks are shared, and a sequence always computes at least its last
token (its logits are needed), so no sequence ever writes into a shared block.

The hash is BLAKE2b (64-bit digest) over the parent hash and the token ids: stable across
processes (gateways compute the same values from a request's tokens, and the values fit the
MessagePack integers the KV events carry), and keyed by a cryptographic hash rather than
Python's tuple hash, so no user can craft a prompt whose blocks collide with another's (that
would need a second preimage, 2**64 work).

`check_integrity()` proves the invariants; tests and idle instances call it.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

ROOT_HASH = 0  # the parent of a sequence's first block


@functools.cache  # one per block size in use
def _packer(num_tokens: int) -> Callable[..., bytes]:
    """The hashed bytes: the parent hash (8 bytes, little-endian, unsigned), then each token
    id as a signed 8-byte little-endian integer, in one `struct` call (cheaper than building
    them piece by piece, and the same bytes)."""
    return struct.Struct(f"<Q{num_tokens}q").pack


def hash_block(parent: int, tokens: Sequence[int]) -> int:
    data = _packer(len(tokens))(parent, *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def iter_block_hashes(token_ids: Sequence[int], block_size: int, num_tokens: int | None = None,
                      parent: int = ROOT_HASH, first_block: int = 0,
                      known: Sequence[int] = ()) -> Iterator[int]:
    """Chained hashes of the full blocks of `token_ids[:num_tokens]`, from `first_block` on
    (`parent` being the hash of the block before it); lazy, so a lookup stops at a miss.
    `known`: the hashes of the leading blocks as another process computed them from the same
    tokens (a prefill instance's, in its offer), taken instead of hashing those blocks again."""
    end = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    for index in range(first_block, end // block_size):
        if index < len(known):
            parent = known[index]
        else:
            parent = hash_block(parent, token_ids[index * block_size:(index + 1) * block_size])
        yield parent


class BlockPoolError(RuntimeError):
    """A bookkeeping invariant was violated (double free, leak, unknown block)."""


@dataclass
class KVEvents:
    """Block hashes cached and evicted since the last drain (what cache-aware routers read)."""

    stored: list[int]
    removed: list[int]


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # count-0 blocks, handed out uncached ones first (FIFO), then cached ones, least
        # recently released first (LRU eviction)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, int] = {}  # block -> hash, for cached blocks
        self._cached: dict[int, int] = {}  # hash -> block
        self.record_events = False  # cache-aware routing turns this on
        self._events = KVEvents([], [])

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take now: unowned ones, cached or not."""
        return len(self._free) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` blocks with count 1 (evicting cached contents), or None (and nothing
        taken) if too few are free."""
        if num_blocks > self.num_free_blocks:
            return None
        blocks = [(self._free or self._free_cached).popitem(last=False)[0]
                  for _ in range(num_blocks)]
        for block in blocks:
            self._ref_counts[block] = 1
            self._evict(block)
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
        """Drop one reference from each block; blocks reaching zero are free again (cached ones
        stay cached, to be evicted last)."""
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
                (self._free_cached if block in self._hash_of else self._free)[block] = None

    # -- the prefix cache ------------------------------------------------------------------------
    def cached_block(self, block_hash: int) -> int | None:
        """The block cached under `block_hash`, if any (a lookup takes nothing)."""
        return self._cached.get(block_hash)

    def share(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on cached blocks, owned or not (a prefix hit)."""
        for block in block_ids:
            if block not in self._hash_of:
                raise BlockPoolError(f"block {block} is not cached")
            if self._ref_counts[block] == 0:
                del self._free_cached[block]
            self._ref_counts[block] += 1

    def cache(self, block: int, block_hash: int) -> None:
        """Register an owned, full block under its hash; a hash another block already holds
        stays with that one (this block is then simply not shared)."""
        if self._ref_counts[block] <= 0:
            raise BlockPoolError(f"cannot cache free block {block}")
        if block_hash in self._cached or block in self._hash_of:
            return
        self._cached[block_hash] = block
        self._hash_of[block] = block_hash
        if self.record_events:
            self._events.stored.append(block_hash)

    def _evict(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._cached[block_hash]
            if self.record_events:
                self._events.removed.append(block_hash)

    def drain_events(self) -> KVEvents:
        events, self._events = self._events, KVEvents([], [])
        return events

    def cached_hashes(self) -> list[int]:
        """Every hash cached now (a full snapshot, for a router that starts late)."""
        return list(self._cached)

    def check_integrity(self) -> None:
        for block, count in enumerate(self._ref_counts):
            free = block in self._free or block in self._free_cached
            if count < 0:
                raise BlockPoolError(f"block {block} has negative count {count}")
            if (count == 0) != free:
                raise BlockPoolError(f"block {block} has count {count} but is "
                                     f"{'' if free else 'not '}in the free list")
            if free and (block in self._free_cached) != (block in self._hash_of):
                raise BlockPoolError(f"free block {block} is in the wrong free queue")
        if len(self._cached) != len(self._hash_of) or any(
                self._cached.get(h) != b for b, h in self._hash_of.items()):
            raise BlockPoolError("the prefix cache's hash and block maps disagree")


@dataclass
class PrefixStats:
    """Cumulative prefix-cache counters, in tokens (vLLM's hit rate is hits / queries)."""

    queries: int = 0  # tokens of the sequences that looked up the cache
    hits: int = 0  # of those, tokens whose KV was found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Per-sequence block tables over a `BlockPool`; the only KV API schedulers use."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[int]] = {}  # hashes of each table's cached leading blocks
        # hashes a sequence's sender computed for its leading blocks (`claim_prefix(known=)`)
        self._known: dict[str, list[int]] = {}
        self.stats = PrefixStats()

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

    def block_hashes(self, seq_id: str) -> list[int]:
        """The hashes of the sequence's leading blocks registered so far (for its KV offer)."""
        return list(self._hashes.get(seq_id, ()))

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

    def claim_prefix(self, seq_id: str, token_ids: Sequence[int], max_tokens: int,
                     known: Sequence[int] = ()) -> int:
        """Start a table for a sequence that has none with the cached blocks of its longest
        cached prefix (whole blocks within the first `max_tokens` tokens). Returns how many
        tokens' KV the table now holds (0 with caching off or on a miss). `known`: the hashes
        of its leading full blocks as the sender computed them (a KV offer's `block_hashes`),
        used here and by `cache_computed` instead of hashing the same tokens again; the sender
        is a peer instance of the same cluster, trusted as much as the KV it sends."""
        if not self.prefix_caching or seq_id in self._tables or max_tokens <= 0:
            return 0
        if known:
            self._known[seq_id] = list(known)
        hashes, blocks = [], []
        for block_hash in iter_block_hashes(token_ids, self.block_size, max_tokens,
                                            known=known):
            block = self.pool.cached_block(block_hash)
            if block is None:
                break
            hashes.append(block_hash)
            blocks.append(block)
        self.stats.queries += max_tokens
        self.stats.hits += len(blocks) * self.block_size
        if blocks:
            self.pool.share(blocks)
            self._tables[seq_id] = list(blocks)
            self._hashes[seq_id] = hashes
        return len(blocks) * self.block_size

    def cache_computed(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the sequence's blocks that are now full of computed KV (`token_ids` being
        the sequence's tokens from its first), so later sequences can share them."""
        table = self._tables.get(seq_id)
        if not self.prefix_caching or not table:
            return
        hashes = self._hashes.setdefault(seq_id, [])
        parent = hashes[-1] if hashes else ROOT_HASH
        limit = min(num_computed, len(table) * self.block_size)
        for index, block_hash in enumerate(iter_block_hashes(
                token_ids, self.block_size, limit, parent, first_block=len(hashes),
                known=self._known.get(seq_id, ())), start=len(hashes)):
            self.pool.cache(table[index], block_hash)
            hashes.append(block_hash)

    def fork(self, seq_id: str, new_seq_id: str) -> list[int]:
        """Give `new_seq_id` a table sharing every block of `seq_id` (copy-free, counted)."""
        if new_seq_id in self._tables:
            raise BlockPoolError(f"sequence {new_seq_id!r} already has blocks")
        table = self.table(seq_id)
        self.pool.fork(table)
        self._tables[new_seq_id] = list(table)
        self._hashes[new_seq_id] = list(self._hashes.get(seq_id, []))
        return self._tables[new_seq_id]

    def free(self, seq_id: str) -> int:
        """Release every block of the sequence (tail first; cached ones stay cached until
        evicted). Returns how many were released."""
        self._hashes.pop(seq_id, None)
        self._known.pop(seq_id, None)
        table = self._tables.pop(seq_id, None)
        if not table:
            return 0
        self.pool.free(table)
        return len(table)

    def check_integrity(self, live_seq_ids: Iterable[str] | None = None) -> None:
        """Pool invariants, plus: every used block is owned, and owned only by live sequences;
        no table records more block hashes than it has blocks."""
        self.pool.check_integrity()
        owned = Counter(block for table in self._tables.values() for block in table)
        for block in range(self.pool.num_blocks):
            if owned.get(block, 0) != self.pool.ref_count(block):
                raise BlockPoolError(f"block {block} has count {self.pool.ref_count(block)} but "
                                     f"{owned.get(block, 0)} owners")
        strays = set(self._known) - set(self._tables)
        if strays:
            raise BlockPoolError(f"sender hashes kept for {len(strays)} sequences without blocks")
        for seq_id, hashes in self._hashes.items():
            if len(hashes) > len(self._tables.get(seq_id, [])):
                raise BlockPoolError(f"{seq_id!r} has more block hashes than blocks")
        if live_seq_ids is not None:
            dead = set(self._tables) - set(live_seq_ids)
            if dead:
                raise BlockPoolError(f"blocks held by {len(dead)} sequences that are not live, "
                                     f"e.g. {sorted(dead)[:3]}")
