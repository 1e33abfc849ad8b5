"""The scheduler contract: plan a forward, absorb its output, report what changed.

    plan = scheduler.schedule()                        # pure Python, no tensors
    output = runner.execute(plan)                      # tensors only in there
    updates = scheduler.update_from_output(plan, output)

A policy assembles each forward in a `PlanBuilder`: the chunks it takes, the KV swaps it decides
on the way and the sequences it preempts travel together and become one `BatchPlan`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from common.block_pool import KVCacheManager
from common.plan import BatchPlan, ModelOutput, ScheduledChunk
from common.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SequenceUpdate:
    """What one forward changed for one sequence: new tokens, and whether it ended."""

    seq_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort" once finished
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list = field(default_factory=list)  # TokenLogprobs per new token, when asked
    prompt_logprobs: list = field(default_factory=list)  # with the first token, when asked


def _wants_prompt_logprobs(seq: Sequence) -> bool:
    """Whether the sequence's prompt chunks compute prompt log-probabilities: asked for and not
    yet delivered (they go out with the first token; a recomputed sequence has sent them)."""
    return seq.sampling.prompt_logprobs is not None and seq.num_output_tokens == 0


@dataclass
class PlanBuilder:
    """One forward under construction, made afresh by each `schedule()` call."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) block pairs
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device) block pairs
    preempted: set[str] = field(default_factory=set)  # sequences evicted while building it

    def add(self, chunk: ScheduledChunk) -> int:
        """Take the chunk; returns its token count (what it costs a token budget)."""
        self.chunks.append(chunk)
        return chunk.num_tokens

    @property
    def seq_ids(self) -> set[str]:
        return {c.seq_id for c in self.chunks}

    def build(self) -> BatchPlan:
        return BatchPlan(self.chunks, swap_out=self.swap_out, swap_in=self.swap_in)


class Scheduler(ABC):
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.sequences: dict[str, Sequence] = {}

    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """Accept a sequence; it runs in some later plan."""

    @abstractmethod
    def schedule(self) -> BatchPlan:
        """The next forward. An empty plan means nothing can run now."""

    @abstractmethod
    def _drop(self, seq: Sequence) -> None:
        """Remove a sequence from the policy's queues (it has finished or been aborted)."""

    def _track(self, seq: Sequence) -> None:
        """Hold a new sequence; its block table is the one `self.kv` keeps for it."""
        seq.kv = self.kv
        self.sequences[seq.seq_id] = seq

    @property
    def has_work(self) -> bool:
        return bool(self.sequences)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.sequences

    def get(self, seq_id: str) -> Sequence | None:
        return self.sequences.get(seq_id)

    def seq_ids(self) -> set[str]:
        return set(self.sequences)

    def sequences_in(self, plan: BatchPlan) -> dict[str, Sequence]:
        """The plan's sequences still held here; read before absorbing the plan's output, which
        lets go of the sequences it finishes."""
        return {c.seq_id: self.sequences[c.seq_id] for c in plan.chunks
                if c.seq_id in self.sequences}

    def past_deadline(self, wall_now: float) -> list[Sequence]:
        return [s for s in self.sequences.values() if s.meta.is_past_deadline(wall_now)]

    def abort(self, seq_id: str) -> SequenceUpdate | None:
        seq = self.sequences.get(seq_id)
        if seq is None:
            return None
        seq.status = SequenceStatus.FINISHED_ABORTED
        self._finish(seq)
        return SequenceUpdate(seq_id, [], "abort", seq.num_prompt_tokens, seq.num_output_tokens)

    def _finish(self, seq: Sequence) -> None:
        self._drop(seq)
        self.kv.free(seq.seq_id)
        del self.sequences[seq.seq_id]

    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> list[SequenceUpdate]:
        updates = []
        for chunk in plan.chunks:
            seq = self.sequences.get(chunk.seq_id)
            if seq is None:  # aborted while its forward ran
                continue
            seq.num_computed_tokens = chunk.num_cached + chunk.num_tokens
            self.kv.cache_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if chunk.seq_id in output.prompt_logprobs:
                # positions before the chunk hold theirs; a recomputed chunk replaces its own
                seq.meta.prompt_logprobs[chunk.num_cached:] = output.prompt_logprobs[chunk.seq_id]
            token = output.sampled_token_ids.get(chunk.seq_id)
            if token is None:
                continue
            seq.append_token(token)
            updates.append(self._token_update(seq, token, output))
            if seq.is_finished:
                self._finish(seq)
        return updates

    @staticmethod
    def _token_update(seq: Sequence, token: int, output: ModelOutput) -> SequenceUpdate:
        """The update of a sequence that just took `token`: its log-probabilities when asked,
        and with the first token the prompt's, which then leave the sequence."""
        logprobs = output.logprobs.get(seq.seq_id)
        prompt_logprobs = []
        if seq.num_output_tokens == 1 and seq.meta.prompt_logprobs:
            prompt_logprobs, seq.meta.prompt_logprobs = seq.meta.prompt_logprobs, []
        return SequenceUpdate(seq.seq_id, [token], seq.finish_reason, seq.num_prompt_tokens,
                              seq.num_output_tokens, [logprobs] if logprobs is not None else [],
                              prompt_logprobs)

    def make_chunk(self, seq: Sequence, num_tokens: int) -> ScheduledChunk | None:
        """Grow the sequence's blocks for `num_tokens` more tokens and describe that chunk, or
        None when the pool is short. The chunk samples when it completes the sequence's tokens.
        A sequence's first chunk starts after its cached prefix, if any: the same number of
        tokens (what the policy budgeted), further along, never past the sequence's end."""
        claimed = self._claim_cached_prefix(seq)
        start = seq.num_computed_tokens
        num_tokens = min(num_tokens, seq.num_tokens - start)
        blocks = self.kv.grow(seq.seq_id, start + num_tokens)
        if blocks is None:
            if claimed:  # hand the shared blocks back: the sequence waits as if never looked up
                self.kv.free(seq.seq_id)
                seq.num_computed_tokens = 0
            return None
        completes = start + num_tokens == seq.num_tokens
        prompt_logprobs = seq.sampling.prompt_logprobs if _wants_prompt_logprobs(seq) else None
        # The penalties read the tokens so far; prompt log-probabilities, the token after a chunk.
        reads_history = (completes and seq.sampling.needs_history) or prompt_logprobs is not None
        return ScheduledChunk(seq.seq_id, seq.token_ids[start:start + num_tokens], start,
                              list(blocks), seq.sampling if completes else None,
                              seq.num_output_tokens,
                              history=seq.token_ids if reads_history else None,
                              num_prompt_tokens=seq.num_prompt_tokens,
                              prompt_logprobs=prompt_logprobs, guide=seq.guide)

    def _claim_cached_prefix(self, seq: Sequence) -> bool:
        """Before a sequence's first chunk: share the cached blocks of its prompt's longest
        cached prefix, leaving at least its last token to compute (its logits sample). Not for
        a sequence owing prompt log-probabilities: cached tokens would have none (as in vLLM)."""
        if seq.num_computed_tokens or self.kv.table(seq.seq_id) or _wants_prompt_logprobs(seq):
            return False
        cached = self.kv.claim_prefix(seq.seq_id, seq.token_ids, seq.num_tokens - 1)
        seq.num_computed_tokens = cached
        return cached > 0

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.sequences)
