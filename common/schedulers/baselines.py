"""The co-located baselines of Sarathi-Serve's taxonomy (§2, Alg. 2) and its ablation (Table 4).

    policy        batches                                 prompts     token budget (tau)
    vllm          prefill-only, else decode-only          whole       prompts of one prefill batch
    orca          hybrid: every decode + new prompts      whole       none (slots and KV only)
    hybrid-only   hybrid, Alg. 3 order                    whole       admission while n_t < tau
    chunked-only  prefill-chunk and decode iterations     chunked     prefill chunks

tau is `BatchConfig.max_num_batched_tokens`, the sequence limit `max_num_seqs`. Every policy
takes running decodes oldest first and, when the KV pool runs dry, preempts the newest running
sequence (by swap when the scheduler has a host tier, else by recompute); a decode that finds
nobody newer to preempt yields its own blocks, as vLLM does. Swapped-out sequences resume before
new prompts are admitted. Sarathi-Serve's own schedulers (microsoft/sarathi-serve,
`sarathi/core/scheduler/`) are the reference for each; docs/coupled.md lists where ours differ.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from common.plan import BatchPlan
from common.schedulers.base import PlanBuilder
from common.schedulers.coupled import CoupledScheduler


class WholePromptScheduler(CoupledScheduler):
    """Helpers of the policies that never chunk a prompt."""

    def _decode_running(self, plan: PlanBuilder, prefilled_only: bool = True) -> int:
        """One token for each running sequence (oldest first); returns the tokens taken."""
        taken = 0
        for seq in list(self.running):
            if seq not in self.running or (prefilled_only and not seq.is_prefilled):
                continue
            chunk = self._chunk_or_preempt(seq, seq.num_uncomputed_tokens, plan)
            if chunk is None:
                self._evict(seq, plan)  # nobody newer to preempt: yield its own blocks
                continue
            taken += plan.add(chunk)
        return taken

    def _resume_decodes(self, plan: PlanBuilder) -> int:
        """Swap in swapped-out sequences for one decode token each; returns the tokens taken."""
        return self.batch.max_num_seqs - self._resume_swapped(plan, self.batch.max_num_seqs)

    def _admit_whole(self, plan: PlanBuilder, can_take: Callable[[int], bool]) -> None:
        """Admit whole prompts FCFS while `can_take(num_tokens)`, the sequence limit and the
        pool allow."""
        while self.waiting and len(self.running) < self.batch.max_num_seqs:
            seq = self.waiting[0]
            if not can_take(seq.num_uncomputed_tokens) \
                    or not self._admit(seq, seq.num_uncomputed_tokens, plan):
                return


class VllmScheduler(WholePromptScheduler):
    """Prefill-prioritizing iteration-level batching (Alg. 2, vLLM): if whole waiting prompts can
    be allocated, a prefill-only batch of as many as fit tau; else one decode token for every
    running sequence. While sequences are swapped out no prompt is admitted (vLLM resumes them
    first).

    NOTE: vLLM without chunking refuses prompts longer than its budget; a prompt longer than tau
    at the head of the queue runs here alone instead, so no request is starved."""

    def schedule(self) -> BatchPlan:
        plan = PlanBuilder()
        if not self.swapped:
            self._admit_prefill_batch(plan)
            if plan.chunks:
                return plan.build()
        self._decode_running(plan)
        self._resume_decodes(plan)
        return plan.build()

    def _admit_prefill_batch(self, plan: PlanBuilder) -> None:
        tau = self.batch.max_num_batched_tokens
        taken = 0

        def can_take(num_tokens: int) -> bool:
            nonlocal taken
            fits = taken + num_tokens <= tau or (not plan.chunks and num_tokens > tau)
            taken += num_tokens if fits else 0
            return fits

        self._admit_whole(plan, can_take)


class OrcaScheduler(WholePromptScheduler):
    """Orca's hybrid batches: one token for every running decode plus whole new prompts, limited
    only by the sequence limit and the KV pool (Orca packs up to max length x batch size prompt
    tokens per iteration; no token budget)."""

    def schedule(self) -> BatchPlan:
        plan = PlanBuilder()
        self._decode_running(plan)
        self._resume_decodes(plan)
        self._admit_whole(plan, lambda num_tokens: True)
        return plan.build()


class HybridOnlyScheduler(WholePromptScheduler):
    """Sarathi-Serve's "hybrid-batching-only" ablation: Alg. 3 with chunking switched off. Decodes
    first, then whole prompts FCFS while the batch holds fewer than tau tokens (Alg. 3's test
    `n_t < tau`, checked before each admission, so the last prompt may overshoot tau). It differs
    from orca only by that budget."""

    def schedule(self) -> BatchPlan:
        plan = PlanBuilder()
        taken = self._decode_running(plan) + self._resume_decodes(plan)
        tau = self.batch.max_num_batched_tokens

        def can_take(num_tokens: int) -> bool:
            nonlocal taken
            if taken >= tau:
                return False
            taken += num_tokens
            return True

        self._admit_whole(plan, can_take)
        return plan.build()


class Turn(Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class ChunkedOnlyScheduler(WholePromptScheduler):
    """Sarathi-Serve's "chunked-prefills-only" ablation (sarathi-serve's SimpleChunkingScheduler):
    prompts are chunked under tau but chunks and decodes never share a forward. Turns alternate:
    a prefill turn runs chunks of partially prefilled sequences, then of new prompts (FCFS); a
    decode turn runs one token for every prefilled sequence. A turn with nothing to do passes to
    the other at once, so no forward is wasted."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.turn = Turn.PREFILL

    def schedule(self) -> BatchPlan:
        plan = PlanBuilder()
        turns = [Turn.PREFILL, Turn.DECODE]
        if self.turn is Turn.DECODE:
            turns.reverse()
        for turn in turns:
            if turn is Turn.PREFILL:
                self._prefill_chunks(plan)
            else:
                self._decode_chunks(plan)
            if plan.chunks:
                self.turn = turns[1] if turn is turns[0] else turns[0]
                break
        return plan.build()

    def _decode_chunks(self, plan: PlanBuilder) -> None:
        self._decode_running(plan)
        self._resume_swapped(plan, self.batch.max_num_seqs, lambda s: s.is_prefilled)

    def _prefill_chunks(self, plan: PlanBuilder) -> None:
        partial = [s for s in self.running if not s.is_prefilled]
        budget = self._continue(plan, partial, self.batch.max_num_batched_tokens)
        budget = self._resume_swapped(plan, budget, lambda s: not s.is_prefilled)
        self._admit_chunked(plan, budget)
