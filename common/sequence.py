"""`Sequence`: the unit that flows through an instance's scheduler (never sent as-is).

There is no prefill or decode phase field: a sequence has `num_computed_tokens` (tokens whose KV is
in the cache) catching up with `num_tokens`. Chunked prefill schedules fewer tokens; a decode
instance receiving a transferred prompt starts at num_computed_tokens == num_prompt_tokens.
"""

from __future__ import annotations

import time
from enum import IntEnum

from common.sampling_params import SamplingParams


class SequenceStatus(IntEnum):
    # Ordered so that `is_finished` is one comparison.
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


FINISH_REASONS = {SequenceStatus.FINISHED_STOPPED: "stop",
                  SequenceStatus.FINISHED_LENGTH: "length",
                  SequenceStatus.FINISHED_ABORTED: "abort"}


class Sequence:
    __slots__ = (
        "arrival_time",
        "block_ids",
        "extra",
        "max_model_len",
        "num_computed_tokens",
        "num_prompt_tokens",
        "sampling",
        "seq_id",
        "status",
        "token_ids",
    )

    def __init__(self, seq_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 max_model_len: int, arrival_time: float | None = None) -> None:
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.sampling = sampling
        self.status = SequenceStatus.WAITING
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.max_model_len = max_model_len
        self.extra: dict = {}  # role-specific annotations (predicted bucket, timestamps)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilled(self) -> bool:
        """True once the whole prompt's KV is in the cache."""
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int) -> None:
        """Add a sampled token and finish the sequence if it hit a stop condition."""
        self.token_ids.append(token_id)
        if self.sampling.is_stop_token(token_id):
            self.status = SequenceStatus.FINISHED_STOPPED
        elif (self.num_output_tokens >= self.sampling.max_tokens
              or self.num_tokens >= self.max_model_len):
            self.status = SequenceStatus.FINISHED_LENGTH

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
