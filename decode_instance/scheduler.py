"""Decode scheduling: continuous batching over sequences whose KV arrived from prefill.

A received sequence joins the running batch already prefilled (num_computed_tokens = its
prompt), so a forward is one token per running sequence. If the KV pool runs dry, the newest
sequence is preempted (`common.schedulers.queues`): swapped out to the host tier when the
instance has one, else dropped and later recomputed here, chunk by chunk, under the token
budget. This planner is the decode instance's own: the co-located policies share its queues and
preemption, not its plan.
"""

from __future__ import annotations

from common.plan import BatchPlan, ModelOutput
from common.schedulers.base import PlanBuilder, SequenceUpdate
from common.schedulers.queues import QueueScheduler
from common.sequence import Sequence, SequenceStatus
from decode_instance.admission import SeqView, migrate


class DecodeScheduler(QueueScheduler):
    """With a host swap tier (`swap`), memory shortage swaps sequences out instead of
    recomputing them; a sequence's prediction moves to the next bucket when it outgrows it."""

    def add_prefilled(self, seq: Sequence) -> None:
        """Start decoding a sequence whose prompt KV is already in its blocks."""
        seq.status = SequenceStatus.RUNNING
        self._track(seq)
        self.running.append(seq)

    def schedule(self) -> BatchPlan:
        """Decodes first, oldest first; then what preemption left: recomputes in progress,
        swapped-out sequences (not in a forward that preempted), recomputes to start."""
        plan = PlanBuilder()
        decoding = [s for s in self.running if s.is_prefilled]
        recomputing = [s for s in self.running if not s.is_prefilled]
        budget = self._continue(plan, decoding + recomputing, self.batch.max_num_batched_tokens)
        self._admit_chunked(plan, self._resume_swapped(plan, budget))
        return plan.build()

    def running_views(self) -> list[SeqView]:
        """The running sequences as the admission policy sees them."""
        return [SeqView(s.num_tokens, s.num_output_tokens, s.meta.prediction)
                for s in self.running]

    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> list[SequenceUpdate]:
        updates = super().update_from_output(plan, output)
        for seq in self.running:
            seq.meta.prediction = migrate(seq.meta.prediction, seq.num_output_tokens)
        return updates
