"""Block pool and per-sequence block tables: allocation, sharing, freeing and the integrity
check."""

from __future__ import annotations

import pytest

from common.block_pool import BlockPool, BlockPoolError, KVCacheManager


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4)
    assert pool.allocate(5) is None and pool.num_free_blocks == 4
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free_blocks == 1
    pool.check_integrity()


def test_double_free_and_unknown_block_are_errors():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free(blocks)
    with pytest.raises(BlockPoolError, match="unknown"):
        pool.free([7])
    with pytest.raises(BlockPoolError):
        pool.fork([0])
    pool.check_integrity()


def test_shared_blocks_return_only_after_last_owner():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.grow("a", 10)
    kv.fork("a", "b")
    assert kv.num_free_blocks == 5
    kv.free("a")
    assert kv.num_free_blocks == 5
    kv.free("b")
    assert kv.num_free_blocks == 8
    kv.check_integrity([])


def test_integrity_detects_dead_owner():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.grow("gone", 4)
    with pytest.raises(BlockPoolError, match="not live"):
        kv.check_integrity(live_seq_ids=[])


def test_grow_covers_tokens_and_is_append_only():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    first = list(kv.grow("s", 5))
    assert len(first) == 2
    grown = kv.grow("s", 13)
    assert grown[:2] == first and len(grown) == 4
    assert kv.grow("s", 100) is None and len(kv.table("s")) == 4  # nothing taken on failure


# The random grow / fork / free state machine (with and without the prefix cache) is in
# test_prefix_cache.py.
