"""Block pool and per-sequence block tables: invariants under random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

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


class BlockTableMachine(RuleBasedStateMachine):
    """Random grow / fork / free sequences never leak or double-free a block."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=24, block_size=4)
        self.tokens: dict[str, int] = {}
        self.counter = 0

    @rule(tokens=st.integers(min_value=1, max_value=40))
    def new_sequence(self, tokens):
        seq_id = f"s{self.counter}"
        self.counter += 1
        before = self.kv.num_free_blocks
        table = self.kv.grow(seq_id, tokens)
        if table is None:
            assert self.kv.num_free_blocks == before
        else:
            self.tokens[seq_id] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(min_value=1, max_value=20))
    def grow(self, data, extra):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.kv.grow(seq_id, self.tokens[seq_id] + extra) is not None:
            self.tokens[seq_id] += extra

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        child = f"s{self.counter}"
        self.counter += 1
        self.kv.fork(seq_id, child)
        self.tokens[child] = self.tokens[seq_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(seq_id)
        del self.tokens[seq_id]

    @invariant()
    def consistent(self):
        self.kv.check_integrity(self.tokens)
        for seq_id, tokens in self.tokens.items():
            assert len(self.kv.table(seq_id)) >= self.kv.num_blocks_for(tokens)
        if not self.tokens:
            assert self.kv.num_free_blocks == self.kv.num_blocks


TestBlockTables = BlockTableMachine.TestCase
TestBlockTables.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
