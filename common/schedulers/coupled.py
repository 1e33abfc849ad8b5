"""Co-located (coupled) scheduling policies: prefill and decode share one instance.

`CoupledScheduler` holds what every coupled policy shares: the waiting queue (FCFS), the running
batch, the swapped-out queue, and preemption. When the KV pool runs dry the newest running
sequence is preempted: by swap when the scheduler has a host tier (`SwapSpace`) with room, its KV
copied out and later back, so it resumes without recompute; else by recompute, its blocks dropped
and its tokens prefilled again later.

`StallFreeScheduler` is Sarathi-Serve's stall-free batching (Alg. 3): every forward first takes
one token for each running decode, then continues partially prefilled prompts, then resumes
swapped-out sequences, then admits new prompts, all under one token budget
(`max_num_batched_tokens`); prompts are chunked to fit. Running decodes never wait for a whole
prompt.

The other policies register in `COUPLED_POLICIES` from their own modules, imported at the end of
this one so that every policy is known wherever the registry is: `baselines` (vllm, orca,
chunked-only, hybrid-only) and `fastserve`. docs/coupled.md describes them all.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import fields

from common.block_pool import KVCacheManager
from common.config import BatchConfig
from common.plan import BatchPlan, ModelOutput, ScheduledChunk
from common.registry import Registry
from common.schedulers.base import Scheduler, SequenceUpdate
from common.schedulers.swapping import SwapSpace
from common.sequence import Sequence, SequenceStatus

COUPLED_POLICIES: Registry[type[CoupledScheduler]] = Registry("coupled policy")


class CoupledScheduler(Scheduler):
    """Shared queues and preemption of the coupled policies.

    Subclasses implement `schedule()`, which starts with `self._begin_plan()` and returns
    `self._plan(chunks)` so that the swaps decided on the way travel with the plan.
    `options_cls` names a policy's own options dataclass (None: the policy has none);
    `make_coupled_scheduler` builds it from a dict.
    """

    options_cls: type | None = None

    def __init__(self, batch: BatchConfig, kv: KVCacheManager, swap: SwapSpace | None = None,
                 options: object | None = None) -> None:
        super().__init__(kv)
        self.batch = batch
        self.swap = swap
        self.options = options
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()  # preempted by swap, oldest first
        self.num_preemptions = 0
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._evicted_now: set[str] = set()  # sequences preempted while building this plan

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

    def unstarted(self) -> list[Sequence]:
        """Waiting sequences with nothing computed or generated yet: they can run elsewhere."""
        return [s for s in self.waiting if s.num_computed_tokens == 0 and s.num_output_tokens == 0]

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

    # -- plan assembly ---------------------------------------------------------------------------
    def _begin_plan(self) -> None:
        self._swap_out, self._swap_in = [], []
        self._evicted_now = set()

    def _plan(self, chunks: list[ScheduledChunk]) -> BatchPlan:
        return BatchPlan(chunks, swap_out=self._swap_out, swap_in=self._swap_in)

    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> list[SequenceUpdate]:
        if self.swap is not None:
            self.swap.release_deferred()  # the plan ran, so its swap-ins have been copied
        return super().update_from_output(plan, output)

    # -- preemption ------------------------------------------------------------------------------
    def _evict(self, victim: Sequence) -> None:
        """Take a running sequence off the device: swap it out if the host tier has room, else
        drop its KV so that it is recomputed from its first token."""
        self.running.remove(victim)
        victim.status = SequenceStatus.PREEMPTED
        self.num_preemptions += 1
        self._evicted_now.add(victim.seq_id)
        pairs = self.swap.swap_out(victim, self.kv) if self.swap is not None else None
        if pairs is not None:
            self._swap_out.extend(pairs)
            self.swapped.append(victim)
            return
        self.kv.free(victim.seq_id)
        victim.num_computed_tokens = 0
        self.waiting.appendleft(victim)

    def _preempt_newest(self, protected: set[str]) -> bool:
        """Evict the newest running sequence not in `protected`."""
        for victim in reversed(self.running):
            if victim.seq_id not in protected:
                self._evict(victim)
                return True
        return False

    def _chunk_or_preempt(self, seq: Sequence, num_tokens: int,
                          scheduled: list[ScheduledChunk]) -> ScheduledChunk | None:
        """A chunk for `seq`, preempting newer sequences not already in this plan if needed."""
        protected = {c.seq_id for c in scheduled} | {seq.seq_id}
        while True:
            chunk = self.make_chunk(seq, num_tokens)
            if chunk is not None or not self._preempt_newest(protected):
                return chunk

    # -- resuming swapped-out sequences ----------------------------------------------------------
    def _try_swap_in(self, seq: Sequence, num_next_tokens: int) -> bool:
        """Bring a swapped-out sequence's KV back if its next chunk fits too; it runs again."""
        need = self.swap.num_device_blocks_to_resume(seq, self.kv, num_next_tokens)
        if need > self.kv.num_free_blocks:
            return False
        self._swap_in.extend(self.swap.swap_in(seq, self.kv))
        seq.status = SequenceStatus.RUNNING
        self.swapped.remove(seq)
        self.running.append(seq)
        return True

    def _resume_swapped(self, chunks: list[ScheduledChunk], budget: int,
                        want: Callable[[Sequence], bool] | None = None) -> int:
        """Swap in and schedule swapped-out sequences (those `want` accepts), oldest first, while
        the budget, the sequence limit and the pool allow; never in a plan that preempted
        (vLLM's rule: no sequence is swapped out and back in one step). Returns the budget left."""
        if self._evicted_now:
            return budget
        for seq in list(self.swapped):
            if want is not None and not want(seq):
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if num_tokens <= 0 or len(self.running) >= self.batch.max_num_seqs \
                    or not self._try_swap_in(seq, num_tokens):
                break
            chunk = self.make_chunk(seq, num_tokens)  # cannot fail: its blocks were counted
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return budget

    def _admit(self, seq: Sequence, num_tokens: int,
               chunks: list[ScheduledChunk]) -> bool:
        """Start the head of the waiting queue with a chunk of `num_tokens`, if blocks allow."""
        chunk = self.make_chunk(seq, num_tokens)
        if chunk is None:
            return False
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        chunks.append(chunk)
        return True

    def check_integrity(self) -> None:
        super().check_integrity()
        if self.swap is not None:
            self.swap.check_integrity(self.sequences)


def make_coupled_scheduler(policy: str, batch: BatchConfig, kv: KVCacheManager,
                           swap: SwapSpace | None = None,
                           options: dict | None = None) -> CoupledScheduler:
    """The registered policy `policy`, with its options dataclass built from `options`."""
    cls = COUPLED_POLICIES.get(policy)
    if options and cls.options_cls is None:
        raise ValueError(f"coupled policy {policy!r} takes no options, got {sorted(options)}")
    if cls.options_cls is None:
        return cls(batch, kv, swap, None)
    defaults = {f.name: f.default for f in fields(cls.options_cls)}
    unknown = set(options or {}) - set(defaults)
    if unknown:
        raise ValueError(f"unknown {policy} options {sorted(unknown)}; known: {sorted(defaults)}")
    # Values may come from the command line as numbers: cast each to its default's type
    # (8.0 -> 8 queues, 0.0 -> False).
    typed = {k: type(defaults[k])(v) for k, v in (options or {}).items()}
    return cls(batch, kv, swap, cls.options_cls(**typed))


@COUPLED_POLICIES.register("sarathi", "stall-free")
class StallFreeScheduler(CoupledScheduler):
    def schedule(self) -> BatchPlan:
        self._begin_plan()
        budget = self.batch.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        # 1. one token for every running decode; 2. continue partial prefills
        for seq in sorted(list(self.running), key=lambda s: not s.is_prefilled):
            if seq not in self.running or budget <= 0:
                continue
            chunk = self._chunk_or_preempt(seq, min(seq.num_uncomputed_tokens, budget), chunks)
            if chunk is None:
                continue
            chunks.append(chunk)
            budget -= chunk.num_tokens
        # 3. resume swapped-out sequences; 4. admit new prompts while budget, slots, blocks allow
        budget = self._resume_swapped(chunks, budget)
        while self.waiting and budget > 0 and len(self.running) < self.batch.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, min(seq.num_uncomputed_tokens, budget), chunks):
                break
            budget -= chunks[-1].num_tokens
        return self._plan(chunks)


# NOTE: imported last, for their registration side effect; they import this module's names,
# which exist by now.
from common.schedulers import baselines, fastserve  # noqa: F401
