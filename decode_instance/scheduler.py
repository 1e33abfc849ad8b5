"""Decode scheduling: continuous batching over sequences whose KV arrived from prefill.

A received sequence joins the running batch already prefilled (num_computed_tokens = its
prompt), so every forward is one token per running sequence. If the KV pool runs dry, the
newest sequence is preempted and later recomputed here, chunk by chunk, under the token budget
(the stall-free policy's rules, which this scheduler inherits).
"""

from __future__ import annotations

from common.schedulers.coupled import StallFreeScheduler
from common.sequence import Sequence, SequenceStatus
from decode_instance.admission import migrate


class DecodeScheduler(StallFreeScheduler):
    """With a host swap tier (`swap`), memory shortage swaps sequences out instead of
    recomputing them; a sequence's prediction moves to the next bucket when it outgrows it."""

    def add_prefilled(self, seq: Sequence) -> None:
        """Start decoding a sequence whose prompt KV is already in its blocks."""
        seq.status = SequenceStatus.RUNNING
        self.sequences[seq.seq_id] = seq
        self.running.append(seq)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def update_from_output(self, plan, output):
        updates = super().update_from_output(plan, output)
        for seq in self.running:
            if seq.extra.get("prediction") is not None:
                seq.extra["prediction"] = migrate(seq.extra["prediction"], seq.num_output_tokens)
        return updates
