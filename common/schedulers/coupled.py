"""Co-located (coupled) scheduling policies: prefill and decode share one instance.

`StallFreeScheduler` is Sarathi-Serve's stall-free batching (Alg. 3): every forward first takes
one token for each running decode, then continues partially prefilled prompts, then admits new
prompts, all under one token budget; prompts are chunked to fit. Running decodes never wait for a
whole prompt. When the KV pool runs dry, the newest running sequence is preempted by recompute.

The other coupled policies (vllm, orca, fastserve) register in the same registry.
"""

from __future__ import annotations

from collections import deque

from common.block_pool import KVCacheManager
from common.config import BatchConfig
from common.plan import BatchPlan, ScheduledChunk
from common.registry import Registry
from common.schedulers.base import Scheduler
from common.sequence import Sequence, SequenceStatus

COUPLED_POLICIES: Registry[type["CoupledScheduler"]] = Registry("coupled policy")


class CoupledScheduler(Scheduler):
    """Shared queues and preemption of the coupled policies."""

    def __init__(self, batch: BatchConfig, kv: KVCacheManager) -> None:
        super().__init__(kv)
        self.batch = batch
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.sequences[seq.seq_id] = seq
        self.waiting.append(seq)

    def _drop(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt_newest(self, protected: set[str]) -> bool:
        """Free the newest running sequence not in `protected` (it is recomputed later)."""
        for victim in reversed(self.running):
            if victim.seq_id not in protected:
                self.running.remove(victim)
                self.kv.free(victim.seq_id)
                victim.block_ids = []
                victim.num_computed_tokens = 0
                victim.status = SequenceStatus.PREEMPTED
                self.waiting.appendleft(victim)
                self.num_preemptions += 1
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


@COUPLED_POLICIES.register("sarathi", "stall-free")
class StallFreeScheduler(CoupledScheduler):
    def schedule(self) -> BatchPlan:
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
        # 3. admit new prompts while budget, sequence slots and blocks allow
        while self.waiting and budget > 0 and len(self.running) < self.batch.max_num_seqs:
            seq = self.waiting[0]
            chunk = self.make_chunk(seq, min(seq.num_uncomputed_tokens, budget))
            if chunk is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return BatchPlan(chunks)
