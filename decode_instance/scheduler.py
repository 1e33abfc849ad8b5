"""Decode scheduling: continuous batching over sequences whose KV arrived from prefill.

A received sequence joins the running batch already prefilled (num_computed_tokens = its
prompt), so every forward is one token per running sequence. If the KV pool runs dry, the
newest sequence is preempted and later recomputed here, chunk by chunk, under the token budget
(the stall-free policy's rules, which this scheduler inherits).
"""

from __future__ import annotations

from common.schedulers.coupled import StallFreeScheduler
from common.sequence import Sequence, SequenceStatus


class DecodeScheduler(StallFreeScheduler):
    def add_prefilled(self, seq: Sequence) -> None:
        """Start decoding a sequence whose prompt KV is already in its blocks."""
        seq.status = SequenceStatus.RUNNING
        self.sequences[seq.seq_id] = seq
        self.running.append(seq)

    @property
    def num_running(self) -> int:
        return len(self.running)
