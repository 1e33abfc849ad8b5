"""Prefill scheduling (TetriInfer §3.3.1): raw queue -> scheduled queue -> fixed-size chunks.

    arrivals -> raw queue --(PrefillSchedBatch at a time, sorted FCFS/SJF/LJF)--> scheduled queue
    scheduled queue -> forwards of ChunkSize tokens: the head's remaining prompt first, then the
                       next prompts' beginnings, merged across requests; optionally zero-padded
    end of a prompt -> first token sampled -> handed to the dispatcher (`take_prefilled`)

Only prompt tokens are computed here; a prefilled sequence leaves the scheduler with its blocks
still allocated (the role holds them under a lease until a decode instance has copied them).
A policy is a sort key of the scheduled queue, found by name in `common.plugins.PREFILL_POLICIES`
(entry points `splitserve.prefill_policies`): `fcfs`, `sjf`, `ljf` below.
"""

from __future__ import annotations

from collections import deque

from common.block_pool import KVCacheManager
from common.config import PrefillConfig
from common.plan import BatchPlan, ModelOutput, ScheduledChunk
from common.plugins import PREFILL_POLICIES
from common.schedulers.base import Scheduler, SequenceUpdate
from common.sequence import Sequence, SequenceStatus


def fcfs(seq: Sequence) -> float:
    """First come, first served."""
    return seq.arrival_time


def sjf(seq: Sequence) -> tuple[int, float]:
    """Shortest prompt first (then first come)."""
    return seq.num_prompt_tokens, seq.arrival_time


def ljf(seq: Sequence) -> tuple[int, float]:
    """Longest prompt first (then first come)."""
    return -seq.num_prompt_tokens, seq.arrival_time


class PrefillScheduler(Scheduler):
    def __init__(self, config: PrefillConfig, chunk_size: int, kv: KVCacheManager) -> None:
        super().__init__(kv)
        self.config = config
        self.sort_key = PREFILL_POLICIES.get(config.policy)
        self.chunk_size = chunk_size
        self.raw: deque[Sequence] = deque()
        self.scheduled: deque[Sequence] = deque()
        self._prefilled: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self._track(seq)
        self.raw.append(seq)

    def _drop(self, seq: Sequence) -> None:
        for queue in (self.raw, self.scheduled):
            if seq in queue:
                queue.remove(seq)

    def _refill(self) -> None:
        """Move up to PrefillSchedBatch raw requests, sorted by the policy, to the scheduled
        queue once it has run dry; the window bounds how long any request can be passed over."""
        if self.scheduled or not self.raw:
            return
        batch = [self.raw.popleft() for _ in range(min(self.config.sched_batch, len(self.raw)))]
        self.scheduled.extend(sorted(batch, key=self.sort_key))

    def schedule(self) -> BatchPlan:
        self._refill()
        budget = self.chunk_size
        chunks: list[ScheduledChunk] = []
        for seq in self.scheduled:
            if budget <= 0:
                break
            # num_tokens, not num_prompt_tokens: a recovered request also recomputes the output
            # it had already generated.
            chunk = self.make_chunk(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
            if chunk is None:
                break  # out of blocks: later prompts wait for leases to be released
            seq.status = SequenceStatus.RUNNING
            chunks.append(chunk)
            budget -= chunk.num_tokens
        padding = budget if self.config.pad_last_chunk and chunks else 0
        return BatchPlan(chunks, num_padding_tokens=padding)

    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> list[SequenceUpdate]:
        updates = super().update_from_output(plan, output)
        for update in updates:
            seq = self.sequences.get(update.seq_id)
            if seq is not None:  # prefilled and not finished by its first token
                self._drop(seq)
                del self.sequences[seq.seq_id]
                self._prefilled.append(seq)
        return updates

    def take_prefilled(self) -> list[Sequence]:
        """Sequences whose prompt is done; their blocks now belong to the caller."""
        taken, self._prefilled = self._prefilled, []
        return taken

    @property
    def has_work(self) -> bool:
        return bool(self.raw or self.scheduled)

    @property
    def num_running(self) -> int:
        """Sequences with part of their prompt computed."""
        return sum(1 for s in self.scheduled if s.num_computed_tokens > 0)

    @property
    def num_waiting(self) -> int:
        return len(self.sequences) - self.num_running

    @property
    def num_queued_tokens(self) -> int:
        return sum(s.num_tokens - s.num_computed_tokens for s in self.sequences.values())
