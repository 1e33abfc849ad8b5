"""The simulator's fast path: a decode instance's steady batch, stepped without planning it.

Most of a simulated hour is decode forwards of a steady batch, and most of their cost was the
plan and the updates, not the policy: while a decode instance's scheduler holds only running
sequences that are each one token behind (nothing waiting, recomputing or swapped out), the
running batch fits the token budget, and the pool has a block for every sequence that needs one,
`DecodeScheduler.schedule()` can only plan one decode token per running sequence, in running
order, growing each table as `make_chunk` does, and `update_from_output` can only append each
sampled token, finish what ended and move predictions on. No policy decides anything there.

`steady_batch` says whether the scheduler is in that state and grows the blocks; `absorb` then
does the rest of those effects on the same objects (the scheduler's sequences, its `KVCacheManager`, its
`_finish`, `Sequence.append_token`, `migrate`), without building the `BatchPlan`, the chunks and
the `SequenceUpdate`s. Whenever the state is anything else (an admission, a preemption, a
recompute, a swap) the real `schedule()` plans the forward. `Layout(steady_decode=False)` turns
the fast path off; tests/unit/simulator/test_steady.py runs whole simulations both ways and
requires the same reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.sequence import Sequence
from decode_instance.admission import migrate
from decode_instance.scheduler import DecodeScheduler
from simulator.workload import EOS_TOKEN, FILLER_TOKEN

if TYPE_CHECKING:
    from simulator.roles import SimDecode


def steady_batch(scheduler: DecodeScheduler) -> tuple[list[Sequence], int] | None:
    """When the next plan can only be one decode token for each running sequence (module
    docstring): the running batch in order, its blocks grown as `make_chunk` grows them, and
    the forward's context (the sum of the chunks' cached tokens). Else None, nothing changed."""
    if type(scheduler) is not DecodeScheduler or scheduler.waiting or scheduler.swapped:
        return None
    running = scheduler.running
    if not running or len(running) > scheduler.batch.max_num_batched_tokens:
        return None
    kv = scheduler.kv
    capacity = kv.block_size
    tables = kv._tables
    context, short = 0, []
    for seq in running:
        num_tokens = len(seq.token_ids)
        if num_tokens - seq.num_computed_tokens != 1:
            return None
        context += num_tokens - 1
        if num_tokens > len(tables.get(seq.seq_id, ())) * capacity:
            short.append(seq)
    if sum(kv.num_new_blocks(s.seq_id, len(s.token_ids)) for s in short) > kv.num_free_blocks:
        return None  # some sequence would preempt another: the scheduler decides
    for seq in short:  # in plan order, as the planner allocates
        kv.grow(seq.seq_id, len(seq.token_ids))
    return list(running), context


def absorb(role: SimDecode, batch: list[Sequence]) -> None:
    """`DecodeScheduler.update_from_output` for the forward `steady_batch` planned, with the sampler's
    tokens as `SimInstance.sampled` draws them, then `SimDecode.absorb`'s reports."""
    scheduler, cluster = role.scheduler, role.cluster
    kv = scheduler.kv
    if scheduler.swap is not None:
        scheduler.swap.release_deferred()
    lengths = cluster.output_lengths
    caching = kv.prefix_caching
    capacity = kv.block_size
    hashes = kv._hashes
    on_token = cluster.on_token
    for seq in batch:
        token_ids = seq.token_ids
        num_computed = len(token_ids)
        seq.num_computed_tokens = num_computed
        # cache_computed acts only when a full block has no hash yet; skip the call otherwise
        if caching and len(hashes.get(seq.seq_id, ())) < num_computed // capacity:
            kv.cache_computed(seq.seq_id, token_ids, num_computed)
        num_output = num_computed - seq.num_prompt_tokens
        seq.append_token(EOS_TOKEN if num_output + 1 >= lengths[seq.seq_id] else FILLER_TOKEN)
        reason = seq.finish_reason
        on_token(seq.seq_id, reason)
        if reason is not None:
            scheduler._finish(seq)
            if reason in ("stop", "length"):
                heavy = role.prediction.is_heavy(seq.meta.first_prediction)
                role.finished["heavy" if heavy else "light"] += 1
    for seq in scheduler.running:
        meta = seq.meta
        if meta.prediction is not None:
            meta.prediction = migrate(meta.prediction, seq.num_output_tokens)
