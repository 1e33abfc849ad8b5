"""Decode scheduling: continuous batching over sequences whose KV arrived from prefill.

A received sequence joins the running batch already prefilled (num_computed_tokens = its
prompt), so every forward is one token per running sequence. If the KV pool runs dry, the
newest sequence is preempted and later recomputed here, chunk by chunk, under the token budget
(the stall-free policy's rules, which this scheduler inherits).
"""

from __future__ import annotations

from common.schedulers.coupled import StallFreeScheduler
from common.sequence import Sequence, SequenceStatus
from decode_instance.admission import SeqView, migrate


class DecodeScheduler(StallFreeScheduler):
    """With a host swap tier (`swap`), memory shortage swaps sequences out instead of
    recomputing them; a sequence's prediction moves to the next bucket when it outgrows it."""

    def add_prefilled(self, seq: Sequence) -> None:
        """Start decoding a sequence whose prompt KV is already in its blocks."""
        seq.status = SequenceStatus.RUNNING
        self._track(seq)
        self.running.append(seq)

    def running_views(self) -> list[SeqView]:
        """The running sequences as the admission policy sees them."""
        return [SeqView(s.num_tokens, s.num_output_tokens, s.meta.prediction)
                for s in self.running]

    def update_from_output(self, plan, output):
        updates = super().update_from_output(plan, output)
        for seq in self.running:
            seq.meta.prediction = migrate(seq.meta.prediction, seq.num_output_tokens)
        return updates
