"""SARATHI's decode-maximal batching (arXiv 2308.16369, §4.2 to §4.4) as a co-located policy.

Each forward holds exactly one prefill chunk and fills every other slot with decodes
("piggybacking"): one token for every running decode (oldest first), swapped-out decodes
resumed, then one chunk of one prompt: the partly prefilled one if there is one, else a
swapped-out one, else the next waiting prompt (FCFS). The sequence limit B = `max_num_seqs` is
the paper's maximum batch: beside a prefilling sequence at most B - 1 decodes run.

Chunk size from the P:D ratio (§4.4): a prompt of P tokens gives P / C chunks, each carrying
B - 1 decodes, so every decode rides on a chunk when P:D >= C / (B - 1), and the gain is largest
at equality:
    C = P:D x (B - 1)
(Table 4's configurations all land near C = 256 this way: 50 x 5, 28 x 9, 63 x 4, 127 x 2.)
With `tile` > 1 the chunk plus the B - 1 decodes is rounded down to a multiple of the tile (the
paper's second step; a GPU's matmul tiles, 1 = off). C is then held within [min_chunk, tau],
tau = `max_num_batched_tokens`: a very low P:D would crawl through prompts, a very high one would
not be chunked at all (the paper's "switch chunk size or fall back" at the extremes).

P:D is `pd_ratio` when given, else measured: prompt tokens over output tokens of the last
`pd_window` requests that finished. Until one has finished the chunk is tau. Decodes are not
counted against the chunk, as in the paper (the batch is C + B - 1 tokens at most).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common.block_pool import KVCacheManager
from common.config import BatchConfig, ConfigError
from common.plan import BatchPlan, ModelOutput
from common.schedulers.base import PlanBuilder, SequenceUpdate
from common.schedulers.coupled import CoupledScheduler
from common.schedulers.swapping import SwapSpace
from common.sequence import Sequence


@dataclass(frozen=True)
class DecodeMaximalOptions:
    pd_ratio: float = 0.0  # prefill tokens per decode token; 0 = measured over finished requests
    pd_window: int = 64  # finished requests the measured P:D looks at
    min_chunk: int = 16  # smallest chunk (tokens), whatever the P:D
    tile: int = 1  # round chunk + B - 1 decodes down to a multiple of this; 1 = no rounding

    def __post_init__(self) -> None:
        if not (self.pd_ratio >= 0 and self.pd_window >= 1 and self.min_chunk >= 1
                and self.tile >= 1):
            raise ConfigError(f"invalid decode-maximal options: {self}")


def decode_maximal_chunk(pd_ratio: float | None, max_num_seqs: int, tau: int,
                         min_chunk: int = 16, tile: int = 1) -> int:
    """The prefill chunk size (module docstring); tau when the P:D is not known yet."""
    if pd_ratio is None:
        return tau
    slots = max(1, max_num_seqs - 1)  # decodes beside the one prefilling sequence
    chunk = int(pd_ratio * slots)
    if tile > 1:
        chunk = (chunk + slots) // tile * tile - slots
    return max(1, min(tau, max(min_chunk, chunk)))


class PDRatio:
    """Prompt tokens over output tokens of the last `window` finished requests."""

    def __init__(self, window: int) -> None:
        self._done: deque[tuple[int, int]] = deque(maxlen=window)

    def finished(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self._done.append((num_prompt_tokens, num_output_tokens))

    @property
    def value(self) -> float | None:
        decode = sum(d for _, d in self._done)
        return sum(p for p, _ in self._done) / decode if decode else None


def _is_decode(seq: Sequence) -> bool:
    """One token left to compute. A sequence being recomputed after preemption has its generated
    tokens left too: it is prefilled in chunks like a prompt."""
    return seq.num_uncomputed_tokens == 1


class DecodeMaximalScheduler(CoupledScheduler):
    """Entry point `decode-maximal`."""

    options_cls = DecodeMaximalOptions

    def __init__(self, batch: BatchConfig, kv: KVCacheManager, swap: SwapSpace | None = None,
                 options: DecodeMaximalOptions | None = None) -> None:
        super().__init__(batch, kv, swap, options or DecodeMaximalOptions())
        self.pd = PDRatio(self.options.pd_window)

    def chunk_size(self) -> int:
        o: DecodeMaximalOptions = self.options
        return decode_maximal_chunk(o.pd_ratio or self.pd.value, self.batch.max_num_seqs,
                                    self.batch.max_num_batched_tokens, o.min_chunk, o.tile)

    def schedule(self) -> BatchPlan:
        plan = PlanBuilder()
        decodes = [s for s in self.running if _is_decode(s)]
        self._continue(plan, decodes, len(decodes))  # one token each: the budget never binds
        self._resume_swapped(plan, self.batch.max_num_seqs, _is_decode)
        self._one_prefill_chunk(plan, self.chunk_size())
        return plan.build()

    def _one_prefill_chunk(self, plan: PlanBuilder, chunk: int) -> None:
        partial = [s for s in self.running if not _is_decode(s)]
        if partial:
            self._continue(plan, partial[:1], chunk)
            return
        swapped = next((s for s in self.swapped if not _is_decode(s)), None)
        if swapped is not None:
            self._resume_swapped(plan, chunk, lambda s: s is swapped)
            return
        if self.waiting and len(self.running) < self.batch.max_num_seqs:
            seq = self.waiting[0]
            if seq.seq_id not in plan.preempted:  # not back in the forward that evicted it
                self._admit(seq, min(seq.num_uncomputed_tokens, chunk), plan)

    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> list[SequenceUpdate]:
        updates = super().update_from_output(plan, output)
        for update in updates:
            if update.finish_reason in ("stop", "length"):
                self.pd.finished(update.num_prompt_tokens, update.num_output_tokens)
        return updates
