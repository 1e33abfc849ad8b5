"""Decode admission policies (TetriInfer §3.4): when may a received sequence join the batch?

Pure functions of block counts and predicted lengths. A sequence's predicted output is one end of
its predicted bucket (`PredictionConfig.predicted_output`: the lower end by default, as the
paper's tests use); a running sequence whose real output reaches the upper end of its bucket
moves on to the next bucket.

- greedy (vLLM): admit while the prompt and the next token fit in the free blocks now;
- reserve-static: admit only if the sequence's predicted total memory (prompt + predicted output)
  fits in the free blocks now;
- reserve-dynamic: admit only if memory will still suffice when the running sequence with the
  shortest predicted remaining length finishes: with r_min that length,
      sum_running blocks(tokens + r_min) + blocks(new tokens + r_min) <= total blocks.

Without a prediction every policy falls back to greedy for that sequence. Policies are found by
name in `common.plugins.ADMISSION_POLICIES` (entry points `splitserve.admission_policies`).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import PredictionConfig
from common.plugins import ADMISSION_POLICIES
from common.protocol import LengthPrediction


@dataclass(frozen=True)
class SeqView:
    num_tokens: int  # tokens whose KV exists or is being computed
    num_output_tokens: int
    prediction: LengthPrediction | None


def predicted_remaining(view: SeqView, config: PredictionConfig) -> int | None:
    output = config.predicted_output(view.prediction)
    if output is None:
        return None
    return max(output - view.num_output_tokens, 1)


def migrate(prediction: LengthPrediction | None,
            num_output_tokens: int) -> LengthPrediction | None:
    """Move a sequence that outgrew its bucket on to the bucket its real length is in."""
    if prediction is None or num_output_tokens < prediction.upper:
        return prediction
    width = max(prediction.upper - prediction.lower, 1)
    bucket = num_output_tokens // width
    return LengthPrediction(bucket, bucket * width, (bucket + 1) * width)


def blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class AdmissionPolicy:
    """Greedy admission (entry point `greedy`), and the base of the other policies."""

    def __init__(self, prediction: PredictionConfig = PredictionConfig()) -> None:
        self.prediction = prediction  # which end of the predicted range a sequence is sized by

    def admits(self, new: SeqView, running: list[SeqView], free_blocks: int, total_blocks: int,
               block_size: int) -> bool:
        """May `new` be admitted now (it still needs its blocks allocated)?"""
        return blocks(new.num_tokens + 1, block_size) <= free_blocks


class ReserveStatic(AdmissionPolicy):
    def admits(self, new, running, free_blocks, total_blocks, block_size):
        remaining = predicted_remaining(new, self.prediction)
        if remaining is None:
            return super().admits(new, running, free_blocks, total_blocks, block_size)
        return blocks(new.num_tokens + remaining, block_size) <= free_blocks


class ReserveDynamic(AdmissionPolicy):
    def admits(self, new, running, free_blocks, total_blocks, block_size):
        if not super().admits(new, running, free_blocks, total_blocks, block_size):
            return False
        remaining = [predicted_remaining(v, self.prediction) for v in [*running, new]]
        known = [r for r in remaining if r is not None]
        if not known:
            return True
        r_min = min(known)
        need = sum(blocks(v.num_tokens + r_min, block_size) for v in running)
        return need + blocks(new.num_tokens + r_min, block_size) <= total_blocks


def make_admission(name: str,
                   prediction: PredictionConfig = PredictionConfig()) -> AdmissionPolicy:
    return ADMISSION_POLICIES.get(name)(prediction)
