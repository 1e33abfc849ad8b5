"""The block pool's prefix cache: chained hashes, sharing, LRU eviction, and the scheduler starting
a sequence's first chunk after its cached prefix."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common import block_pool
from common.block_pool import BlockPoolError, KVCacheManager, hash_block, iter_block_hashes
from common.config import BatchConfig
from common.plan import ModelOutput
from common.sampling_params import SamplingParams
from common.schedulers.coupled import StallFreeScheduler
from common.sequence import Sequence

BS = 4


def cached_kv(num_blocks=16) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, prefix_caching=True)


def run_prompt(kv: KVCacheManager, seq_id: str, tokens: list[int]) -> int:
    """What a scheduler does for one prompt: claim, grow, compute, register. Returns the hit."""
    hit = kv.claim_prefix(seq_id, tokens, len(tokens) - 1)
    kv.grow(seq_id, len(tokens))
    kv.cache_computed(seq_id, tokens, len(tokens))
    return hit


def test_hashes_chain_on_the_whole_prefix_and_ignore_a_partial_block():
    a = list(iter_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS))
    b = list(iter_block_hashes([9, 2, 3, 4, 5, 6, 7, 8], BS))
    assert len(a) == 2 and a[0] == hash_block(0, [1, 2, 3, 4])
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])
    assert a[1] != b[1]  # same tokens in block 2, another prefix before them
    assert list(iter_block_hashes(list(range(12)), BS, parent=a[0], first_block=1)) == \
        [hash_block(a[0], [4, 5, 6, 7]), hash_block(hash_block(a[0], [4, 5, 6, 7]),
                                                    [8, 9, 10, 11])]


def test_a_block_hash_is_blake2b_of_the_documented_bytes():
    """Gateways, prefill and decode instances must agree on every value: the parent hash as 8
    little-endian unsigned bytes, then each token id as 8 little-endian signed bytes."""
    for parent, tokens in [(0, [1, 2, 3, 4]), (2**64 - 1, [0, 49151, 7, 2**40]),
                           (12345, list(range(16))), (7, [-1, 5])]:
        data = parent.to_bytes(8, "little") + b"".join(
            t.to_bytes(8, "little", signed=True) for t in tokens)
        digest = hashlib.blake2b(data, digest_size=8).digest()
        assert hash_block(parent, tokens) == int.from_bytes(digest, "little")


def test_a_receiver_takes_the_senders_hashes_instead_of_hashing_the_prompt_again(monkeypatch):
    tokens = list(range(100, 114))  # three full blocks and two tokens
    sender = cached_kv()
    run_prompt(sender, "s", tokens)
    known = sender.block_hashes("s")
    assert known == list(iter_block_hashes(tokens, BS, len(tokens)))
    hashed = []
    original = block_pool.hash_block
    monkeypatch.setattr(block_pool, "hash_block",
                        lambda parent, blk: hashed.append(list(blk)) or original(parent, blk))
    receiver = cached_kv()
    assert receiver.claim_prefix("r", tokens + [7], len(tokens), known=known) == 0  # a miss
    receiver.grow("r", len(tokens) + 2)
    receiver.cache_computed("r", tokens + [7, 8], len(tokens) + 2)  # a fourth block fills
    assert hashed == [[112, 113, 7, 8]]  # only the block the sender had not registered
    assert receiver.block_hashes("r")[:3] == known
    assert receiver.block_hashes("r")[3] == original(known[-1], [112, 113, 7, 8])
    receiver.check_integrity(["r"])
    assert run_prompt(receiver, "x", tokens[:8] + [1, 2]) == 8  # registered here: shared
    receiver.free("r")
    assert "r" not in receiver._known
    fresh = cached_kv()
    fresh.claim_prefix("stray", tokens, len(tokens), known=known)  # a miss, never grown
    with pytest.raises(BlockPoolError, match="sender hashes kept"):
        fresh.check_integrity()


def test_second_prompt_shares_full_blocks_and_computes_at_least_its_last_token():
    kv = cached_kv()
    prompt = list(range(100, 112))  # 3 full blocks
    assert run_prompt(kv, "a", prompt) == 0
    # the whole prompt is cached, but the last token must run: the hit stops one block short
    assert kv.claim_prefix("b", prompt, len(prompt) - 1) == 8
    assert kv.table("b") == kv.table("a")[:2]
    assert all(kv.pool.ref_count(block) == 2 for block in kv.table("b"))
    kv.check_integrity(["a", "b"])
    assert kv.stats.hits == 8 and kv.stats.queries == 11 + 11


def test_partial_hit_ending_mid_block_shares_only_whole_blocks():
    kv = cached_kv()
    run_prompt(kv, "a", list(range(10)))  # blocks [0..3] [4..7] cached, [8, 9] partial
    assert kv.claim_prefix("b", list(range(6)) + [99, 98, 97], 8) == 4


def test_released_blocks_stay_cached_until_the_pool_needs_them_lru_first():
    kv = cached_kv(num_blocks=5)
    run_prompt(kv, "old", [1] * 8)  # 2 blocks, both cached
    run_prompt(kv, "new", [2] * 8)
    kv.free("old")
    kv.free("new")
    assert kv.num_free_blocks == 5 and kv.pool.num_cached_blocks == 4
    kv.grow("x", 4)  # the one never-cached block goes first
    assert kv.pool.num_cached_blocks == 4
    kv.grow("y", 4)  # then the least recently released: old's tail block (freed tail first)
    assert kv.claim_prefix("o", [1] * 8 + [7], 8) == 4
    assert kv.claim_prefix("n", [2] * 8 + [7], 8) == 8
    kv.grow("z", 4)  # old's head is in use again ("o"): new's blocks are too; nothing to take
    assert kv.table("z") == [] and kv.num_free_blocks == 0
    kv.check_integrity(["x", "y", "o", "n"])


def test_caching_off_never_shares():
    kv = KVCacheManager(16, BS)
    assert run_prompt(kv, "a", list(range(12))) == 0
    assert kv.claim_prefix("b", list(range(12)), 11) == 0 and kv.pool.num_cached_blocks == 0


def test_events_report_stored_and_evicted_hashes():
    kv = cached_kv(num_blocks=2)
    kv.pool.record_events = True
    run_prompt(kv, "a", [5] * 8)
    kv.free("a")
    stored = kv.pool.drain_events().stored
    assert stored == list(iter_block_hashes([5] * 8, BS))
    kv.grow("b", 8)
    assert sorted(kv.pool.drain_events().removed) == sorted(stored)


def _step(sched: StallFreeScheduler, token: int = 7):
    plan = sched.schedule()
    sampled = {c.seq_id: token for c in plan.chunks if c.sampling is not None}
    sched.update_from_output(plan, ModelOutput(sampled_token_ids=sampled))
    return plan


def test_scheduler_starts_the_first_chunk_after_the_cached_prefix():
    kv = cached_kv(num_blocks=32)
    sched = StallFreeScheduler(BatchConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    sched.add(Sequence("a", list(range(30)), greedy, max_model_len=64))
    first = _step(sched)
    assert [(c.num_cached, c.num_tokens) for c in first.chunks] == [(0, 30)]
    sched.add(Sequence("b", list(range(28)) + [500, 501, 502], greedy, max_model_len=64))
    second = _step(sched)
    # 28 shared tokens = 7 whole blocks; b computes from token 28 and samples
    assert [(c.num_cached, c.num_tokens) for c in second.chunks] == [(28, 3)]
    assert second.chunks[0].sampling is not None
    sched.check_integrity()
    assert kv.num_free_blocks == 32


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random prompts from a small alphabet (so prefixes repeat), claims, growth, forks and
    frees: counts, free queues and hash maps stay consistent, shared blocks hold the tokens their
    hash names, and nothing leaks once every sequence is freed."""

    prefix_caching = True

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(20, BS, prefix_caching=self.prefix_caching)
        self.tokens: dict[str, list[int]] = {}
        self.counter = 0
        self.content: dict[int, tuple] = {}  # block -> the tokens it was computed for

    def _register(self, seq_id):
        tokens, table = self.tokens[seq_id], self.kv.table(seq_id)
        self.kv.cache_computed(seq_id, tokens, len(tokens))
        for index in range(len(tokens) // BS):
            block_tokens = (tuple(tokens[:(index + 1) * BS]))
            if self.content.setdefault(table[index], block_tokens) != block_tokens:
                # a block is rewritten only after it was evicted and taken anew
                assert self.kv.pool.ref_count(table[index]) == 1
                self.content[table[index]] = block_tokens

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=24))
    def new_sequence(self, prompt):
        seq_id = f"s{self.counter}"
        self.counter += 1
        before = self.kv.num_free_blocks
        hit = self.kv.claim_prefix(seq_id, prompt, len(prompt) - 1)
        assert hit % BS == 0 and hit <= len(prompt) - 1
        for index, block in enumerate(self.kv.table(seq_id)):  # a hit holds those very tokens
            assert self.content[block] == tuple(prompt[:(index + 1) * BS])
        if self.kv.grow(seq_id, len(prompt)) is None:
            self.kv.free(seq_id)
            assert self.kv.num_free_blocks == before
            return
        self.tokens[seq_id] = list(prompt)
        self._register(seq_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=8))
    def grow(self, data, extra):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens, table = self.tokens[seq_id], self.kv.table(seq_id)
        if len(tokens) % BS and self.kv.pool.ref_count(table[len(tokens) // BS]) > 1:
            return  # a forked, partly filled last block: copy-on-write is the caller's job
        total = self.tokens[seq_id] + extra
        if self.kv.grow(seq_id, len(total)) is not None:
            self.tokens[seq_id] = total
            self._register(seq_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        child = f"s{self.counter}"
        self.counter += 1
        self.kv.fork(seq_id, child)
        self.tokens[child] = list(self.tokens[seq_id])

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
            assert len(self.kv.table(seq_id)) >= self.kv.num_blocks_for(len(tokens))
        if not self.tokens:
            assert self.kv.num_free_blocks == self.kv.num_blocks


class BlockTableMachine(PrefixCacheMachine):
    """The same random operations with the cache off: never a leak or a double free."""

    prefix_caching = False


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestBlockTables = BlockTableMachine.TestCase
TestBlockTables.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
