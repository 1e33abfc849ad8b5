"""`Sequence`: the unit that flows through an instance's scheduler (never sent as-is).

There is no prefill or decode phase field: a sequence has `num_computed_tokens` (tokens whose KV is
in the cache) catching up with `num_tokens`. Chunked prefill schedules fewer tokens; a decode
instance receiving a transferred prompt starts at num_computed_tokens == num_prompt_tokens.

What the roles know of a sequence beyond its tokens (its gateway, deadline, predicted length) is
its `SequenceMeta`. Its block table is not kept here: `block_ids` reads the `KVCacheManager` that
holds the sequence's blocks, the one copy of every table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

from common.block_pool import KVCacheManager
from common.protocol import LengthPrediction
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


@dataclass
class SequenceMeta:
    """What the roles attach to a sequence: where its tokens go, when it must end, and how long
    its output is predicted to be."""

    reply_to: str = ""  # the inbox of the gateway that streams the request
    deadline: float = 0.0  # wall clock (time.time()) after which it is dropped; 0 = none
    arrival_wall: float = 0.0  # wall clock at the gateway (arrival_time is this process's clock)
    # The predicted output bucket; a decode instance moves it on when the output outgrows it.
    prediction: LengthPrediction | None = None
    first_prediction: LengthPrediction | None = None  # as it arrived, to score the predictor
    # decode instance id -> prompt tokens the gateway saw cached there (cache-aware dispatch)
    decode_cached: dict[str, int] = field(default_factory=dict)
    # TokenLogprobs of prompt tokens 1.. gathered chunk by chunk (SamplingParams.prompt_logprobs)
    # until the first token carries them out
    prompt_logprobs: list = field(default_factory=list)

    def is_past_deadline(self, wall_now: float) -> bool:
        return bool(self.deadline) and wall_now > self.deadline


class Sequence:
    __slots__ = (
        "arrival_time",
        "guide",
        "kv",
        "max_model_len",
        "meta",
        "num_computed_tokens",
        "num_prompt_tokens",
        "sampling",
        "seq_id",
        "status",
        "token_ids",
    )

    def __init__(self, seq_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 max_model_len: int, arrival_time: float | None = None,
                 meta: SequenceMeta | None = None) -> None:
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.sampling = sampling
        self.status = SequenceStatus.WAITING
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.max_model_len = max_model_len
        self.meta = meta if meta is not None else SequenceMeta()
        self.kv: KVCacheManager | None = None  # the block tables it is held in (set by a scheduler)
        # The grammar matcher (common.engine.guided.Guide) of a constrained sequence, set by its
        # role once the grammar compiled; it has taken every output token so far.
        self.guide = None

    @property
    def block_ids(self) -> list[int]:
        """The sequence's block table, as its KV manager keeps it (empty while it holds none)."""
        return self.kv.table(self.seq_id) if self.kv is not None else []

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
        if self.sampling.is_stop_token(token_id, self.num_output_tokens):
            self.status = SequenceStatus.FINISHED_STOPPED
        elif (self.num_output_tokens >= self.sampling.max_tokens
              or self.num_tokens >= self.max_model_len):
            self.status = SequenceStatus.FINISHED_LENGTH

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
