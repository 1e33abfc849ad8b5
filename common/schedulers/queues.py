"""Queues and preemption: what the co-located policies and the decode instance's planner share.

`QueueScheduler` holds the waiting queue (FCFS), the running batch and the swapped-out queue, and
the steps a planner composes into a `PlanBuilder`: continue running sequences, resume swapped-out
ones, admit waiting ones. When the KV pool runs dry the newest running sequence is preempted: by
swap when the scheduler has a host tier (`SwapSpace`) with room, its KV copied out and later back,
so it resumes without recompute; else by recompute, its blocks dropped and its tokens prefilled
again later. It plans nothing itself: each planner's `schedule()` picks the steps, their order
and their budgets.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable

from common.block_pool import KVCacheManager
from common.config import BatchConfig
from common.plan import BatchPlan, ModelOutput, ScheduledChunk
from common.schedulers.base import PlanBuilder, Scheduler, SequenceUpdate
from common.schedulers.swapping import SwapSpace
from common.sequence import Sequence, SequenceStatus


class QueueScheduler(Scheduler):
    def __init__(self, batch: BatchConfig, kv: KVCacheManager,
                 swap: SwapSpace | None = None) -> None:
        super().__init__(kv)
        self.batch = batch
        self.swap = swap
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()  # preempted by swap, oldest first
        self.num_preemptions = 0
        # What the policy did, cumulative since start (reported as `policy_counters`): how
        # preemptions ended (swap or recompute) and the swaps' blocks; policies add their own.
        self.counts: Counter[str] = Counter()

    def counters(self) -> dict[str, int]:
        return {"preemptions": self.num_preemptions, "recomputes": self.counts["recomputes"],
                "swap_outs": self.counts["swap_outs"], "swap_ins": self.counts["swap_ins"],
                "blocks_swapped_out": self.counts["blocks_swapped_out"],
                "blocks_swapped_in": self.counts["blocks_swapped_in"]}

    def add(self, seq: Sequence) -> None:
        self._track(seq)
        self.waiting.append(seq)

    def _drop(self, seq: Sequence) -> None:
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        if self.swap is not None:
            self.swap.discard(seq.seq_id)

    # -- load ------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.swapped)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens not computed yet: of waiting sequences and of partly prefilled ones."""
        queued = sum(s.num_uncomputed_tokens for s in self.waiting)
        return queued + sum(s.num_uncomputed_tokens for s in self.running if not s.is_prefilled)

    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> list[SequenceUpdate]:
        if self.swap is not None:
            self.swap.release_deferred()  # the plan ran, so its swap-ins have been copied
        return super().update_from_output(plan, output)

    # -- preemption ------------------------------------------------------------------------------
    def _evict(self, victim: Sequence, plan: PlanBuilder) -> bool:
        """Take a running sequence off the device: swap it out if the host tier has room, else
        drop its KV so that it is recomputed from its first token. True when it was swapped."""
        self.running.remove(victim)
        victim.status = SequenceStatus.PREEMPTED
        self.num_preemptions += 1
        plan.preempted.add(victim.seq_id)
        pairs = self.swap.swap_out(victim, self.kv) if self.swap is not None else None
        if pairs is not None:
            plan.swap_out.extend(pairs)
            self.swapped.append(victim)
            self.counts.update(swap_outs=1, blocks_swapped_out=len(pairs))
            return True
        self.kv.free(victim.seq_id)
        victim.num_computed_tokens = 0
        self.waiting.appendleft(victim)
        self.counts["recomputes"] += 1
        return False

    def _preempt_newest(self, plan: PlanBuilder, protected: set[str]) -> bool:
        """Evict the newest running sequence not in `protected`."""
        for victim in reversed(self.running):
            if victim.seq_id not in protected:
                self._evict(victim, plan)
                return True
        return False

    def _chunk_or_preempt(self, seq: Sequence, num_tokens: int,
                          plan: PlanBuilder) -> ScheduledChunk | None:
        """A chunk for `seq`, preempting newer sequences not already in the plan if needed."""
        protected = plan.seq_ids | {seq.seq_id}
        while True:
            chunk = self.make_chunk(seq, num_tokens)
            if chunk is not None or not self._preempt_newest(plan, protected):
                return chunk

    # -- the steps of a plan ---------------------------------------------------------------------
    def _continue(self, plan: PlanBuilder, seqs: Iterable[Sequence], budget: int) -> int:
        """A chunk for each of `seqs` still running, in that order: its uncomputed tokens, as
        many as the budget leaves (one for a decode), preempting newer sequences for blocks; a
        sequence that finds no blocks sits this forward out. Returns the budget left."""
        for seq in seqs:
            if seq not in self.running or budget <= 0:
                continue
            chunk = self._chunk_or_preempt(seq, min(seq.num_uncomputed_tokens, budget), plan)
            if chunk is not None:
                budget -= plan.add(chunk)
        return budget

    def _try_swap_in(self, seq: Sequence, num_next_tokens: int, plan: PlanBuilder) -> bool:
        """Bring a swapped-out sequence's KV back if its next chunk fits too; it runs again."""
        need = self.swap.num_device_blocks_to_resume(seq, self.kv, num_next_tokens)
        if need > self.kv.num_free_blocks:
            return False
        pairs = self.swap.swap_in(seq, self.kv)
        plan.swap_in.extend(pairs)
        self.counts.update(swap_ins=1, blocks_swapped_in=len(pairs))
        seq.status = SequenceStatus.RUNNING
        self.swapped.remove(seq)
        self.running.append(seq)
        return True

    def _resume_swapped(self, plan: PlanBuilder, budget: int,
                        want: Callable[[Sequence], bool] | None = None) -> int:
        """Swap in and schedule swapped-out sequences (those `want` accepts), oldest first, while
        the budget, the sequence limit and the pool allow; never in a plan that preempted
        (vLLM's rule: no sequence is swapped out and back in one step). Returns the budget left."""
        if plan.preempted:
            return budget
        for seq in list(self.swapped):
            if want is not None and not want(seq):
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if num_tokens <= 0 or len(self.running) >= self.batch.max_num_seqs \
                    or not self._try_swap_in(seq, num_tokens, plan):
                break
            budget -= plan.add(self.make_chunk(seq, num_tokens))  # its blocks were counted
        return budget

    def _admit(self, seq: Sequence, num_tokens: int, plan: PlanBuilder) -> bool:
        """Start the head of the waiting queue with a chunk of `num_tokens`, if blocks allow."""
        chunk = self.make_chunk(seq, num_tokens)
        if chunk is None:
            return False
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        plan.add(chunk)
        return True

    def _admit_chunked(self, plan: PlanBuilder, budget: int) -> int:
        """Start waiting sequences FCFS, each with as much of its prompt as the budget leaves,
        while the budget, the sequence limit and the pool allow. Returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.batch.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, min(seq.num_uncomputed_tokens, budget), plan):
                break
            budget -= plan.chunks[-1].num_tokens
        return budget

    def check_integrity(self) -> None:
        super().check_integrity()
        if self.swap is not None:
            self.swap.check_integrity(self.sequences)
