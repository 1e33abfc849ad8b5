"""FastServe (arXiv 2305.05920) as a coupled policy: skip-join MLFQ with proactive KV swapping.

Every iteration (iteration-level preemption, §4.1):
  1. promote starved jobs to Q1; take the MLFQ's priority order and each job's estimated next
     scheduled time (ENST, §4.2);
  2. select: walk the order and take each job that can run, up to `max_num_seqs` jobs: a decode
     runs one token, a prompt runs whole (FastServe does not chunk), at most
     `max_num_batched_tokens` prompt tokens per iteration but always at least one prompt;
  3. make room: a selected job that needs device blocks (its KV is on the host, or it grows)
     evicts resident lower-priority jobs, latest ENST first: swapped out to the host tier, or,
     when there is no room there (or no host tier), dropped for recompute;
  4. proactive (options.proactive, the default): swap out resident, unselected jobs, latest ENST
     first, until the reserve is free; then swap in swapped-out jobs, earliest ENST first, while
     the reserve stays free, so they are resident before they are scheduled. Reactive mode does
     only step 3.
After the forward each job that ran is charged its predicted iteration time (the job profiler)
and demoted when it used its quantum.

The reserve (§4.2: keep room for the jobs about to run, and idle KV slots for new jobs sized from
the arrival burstiness seen so far), in device blocks, recomputed every iteration:
    reserve = min(max_reserve_fraction * pool,
                  reserved_blocks                      # fixed extra blocks (0 by default)
                  + blocks the selected jobs' next token needs (those at a block boundary)
                  + the largest arrival burst of the last `burst_window` iterations)
where an arrival burst is the blocks (prompt + 1 token) of the jobs that arrived between two
iterations. The cap keeps the reserve from evicting everything on a small pool.

The job profiler (`JobProfiler`): a decode iteration takes the profiled decode step at batch 1
(this is also q1, the first quantum); a prompt of n tokens takes max(q1, the profiled forward of n
tokens), both from a `splitserve profile` result (common.schedulers.costs; the coupled role loads
it). Options given explicitly override the profile; with neither, the constants of an older
machine are used and a warning is logged. Charging predicted rather than measured times keeps the
schedule a pure function of the queues (golden-plan testable) and matches the paper's quanta,
counted in iterations of known length.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from common.block_pool import KVCacheManager
from common.config import BatchConfig, ConfigError
from common.plan import BatchPlan, ModelOutput
from common.schedulers.base import PlanBuilder, SequenceUpdate
from common.schedulers.costs import IterationCosts
from common.schedulers.coupled import CoupledScheduler
from common.schedulers.mlfq import SkipJoinMLFQ
from common.schedulers.swapping import SwapSpace
from common.sequence import Sequence, SequenceStatus


log = logging.getLogger(__name__)

# The job profiler's last resort (SmolLM2-135M, bfloat16, an older 2-core machine): used only
# when neither the options nor a profile give the costs.
FALLBACK_DECODE_S = 0.02
FALLBACK_PREFILL_TOKEN_S = 0.00075


@dataclass(frozen=True)
class FastServeOptions:
    """FastServe's knobs. The two costs default to 0: take them from the profile."""

    # q1 and the predicted time of one decode iteration; 0 = the profile's decode step at batch 1
    seconds_per_decode_iteration: float = 0.0
    # Predicted prefill time per prompt token; 0 = the profile's forward time of n tokens
    seconds_per_prefill_token: float = 0.0
    num_queues: int = 8  # n; the paper leaves it open (its example uses 4)
    # alpha: a job not run for this long returns to Q1 (the paper's default, "300 ms").
    starvation_limit_s: float = 0.3
    reserved_blocks: int = 0  # fixed blocks added to the reserve (proactive mode only)
    burst_window: int = 64  # iterations of arrival history the burst reserve looks at; 0 = none
    max_reserve_fraction: float = 0.5  # the reserve never exceeds this share of the device pool
    proactive: bool = True  # False: swap only when a selected job needs the blocks (reactive)
    skip_join: bool = True  # False: naive MLFQ, every job enters Q1 (FastServe's ablation)

    def __post_init__(self) -> None:
        if not (self.seconds_per_decode_iteration >= 0 and self.seconds_per_prefill_token >= 0
                and self.num_queues >= 1 and self.starvation_limit_s > 0
                and self.reserved_blocks >= 0 and self.burst_window >= 0
                and 0 <= self.max_reserve_fraction <= 1):
            raise ConfigError(f"invalid FastServe options: {self}")


class JobProfiler:
    """FastServe's job profiler: the predicted time of a job's next iteration from its tokens."""

    def __init__(self, decode_s: float, prefill_s: Callable[[int], float], source: str) -> None:
        self.q1 = decode_s  # one decode iteration, the shortest: the first quantum
        self.prefill_s = prefill_s
        self.source = source

    def iteration_s(self, num_tokens: int) -> float:
        return self.q1 if num_tokens <= 1 else max(self.q1, self.prefill_s(num_tokens))

    @classmethod
    def build(cls, options: FastServeOptions, costs: IterationCosts | None) -> JobProfiler:
        """Explicit options first, then the profile's costs, then the fallback constants."""
        decode_s = options.seconds_per_decode_iteration or (costs and costs.decode_step_s(1))
        rate = options.seconds_per_prefill_token
        prefill_s = (lambda n: n * rate) if rate else (costs and costs.forward_s)
        if decode_s and prefill_s:
            explicit = costs is None or (rate and options.seconds_per_decode_iteration)
            return cls(decode_s, prefill_s, "options" if explicit else costs.source)
        log.warning("fastserve: no profile for the job profiler; using constants from an older "
                    "machine (run `splitserve profile` on this one)")
        rate = rate or FALLBACK_PREFILL_TOKEN_S
        return cls(decode_s or FALLBACK_DECODE_S, lambda n: n * rate, "fallback constants")


class ArrivalBursts:
    """The KV blocks of the jobs that arrived between two iterations, over the last `window`
    iterations: what FastServe sizes its reserve for new jobs from (§4.2)."""

    def __init__(self, window: int) -> None:
        self._history: deque[int] = deque(maxlen=max(window, 1))
        self._enabled = window > 0
        self._pending = 0

    def arrived(self, num_blocks: int) -> None:
        self._pending += num_blocks

    def close_iteration(self) -> int:
        """End the gap before this iteration; the largest burst in the window, this one's
        included."""
        self._history.append(self._pending)
        self._pending = 0
        return max(self._history) if self._enabled else 0


def reserve_blocks(fixed: int, next_token_blocks: int, burst: int, num_blocks: int,
                   max_fraction: float) -> int:
    """The reserve rule (module docstring)."""
    return min(int(max_fraction * num_blocks), fixed + next_token_blocks + burst)


class FastServeScheduler(CoupledScheduler):
    """`running` holds the jobs whose KV is on the device, `swapped` those whose KV is on the
    host, `waiting` those with no KV yet (new, or dropped for recompute); the MLFQ alone orders
    them."""

    options_cls = FastServeOptions
    wants_host_tier = True  # proactive swapping is half of the design
    wants_costs = True  # the job profiler reads the profile

    def __init__(self, batch: BatchConfig, kv: KVCacheManager, swap: SwapSpace | None = None,
                 options: FastServeOptions | None = None,
                 costs: IterationCosts | None = None) -> None:
        super().__init__(batch, kv, swap, options or FastServeOptions(), costs)
        o: FastServeOptions = self.options
        self.profiler = JobProfiler.build(o, costs)
        self.mlfq = SkipJoinMLFQ(self.profiler.q1, o.num_queues, o.starvation_limit_s)
        self.bursts = ArrivalBursts(o.burst_window)
        self.reserve = 0  # the last iteration's reserve, in device blocks
        self.clock = time.monotonic  # tests substitute a fake clock

    def add(self, seq: Sequence) -> None:
        super().add(seq)
        self.bursts.arrived(self.kv.num_blocks_for(seq.num_tokens + 1))
        level = self.mlfq.join(seq.seq_id, self.profiler.iteration_s(seq.num_uncomputed_tokens),
                               self.clock(), self.options.skip_join)
        self.counts[f"entered_q{level + 1}"] += 1

    def counters(self) -> dict[str, int]:
        """The shared counters, the jobs entering each queue (Q1 first; skip-join's effect),
        the MLFQ's starvation promotions and demotions, and the swaps made ahead of need."""
        entered = {f"entered_q{k}": self.counts[f"entered_q{k}"]
                   for k in range(1, self.mlfq.num_queues + 1)}
        return {**super().counters(), **entered, "promotions": self.mlfq.num_promotions,
                "demotions": self.mlfq.num_demotions,
                "proactive_swap_outs": self.counts["proactive_swap_outs"],
                "proactive_swap_ins": self.counts["proactive_swap_ins"]}

    def _drop(self, seq: Sequence) -> None:
        super()._drop(seq)
        self.mlfq.remove(seq.seq_id)

    # -- planning --------------------------------------------------------------------------------
    def schedule(self) -> BatchPlan:
        plan = PlanBuilder()
        now = self.clock()
        self.mlfq.promote_starved(now)
        order = [self.sequences[seq_id] for seq_id in self.mlfq.order()]
        enst = self.mlfq.enst([s.seq_id for s in order], now, self.batch.max_num_seqs)
        burst = self.bursts.close_iteration()
        self._select(plan, order, enst)
        if self.options.proactive and self.swap is not None:
            self.reserve = self._reserve(plan, burst)
            self._keep_reserve(plan, enst)
            self._swap_in_ahead(plan, enst)
        return plan.build()

    def _reserve(self, plan: PlanBuilder, burst: int) -> int:
        """The reserve rule over this plan: the jobs it runs keep running (FastServe changes few
        jobs between iterations), so their next token's blocks are kept free with the burst."""
        growth = sum(self.kv.num_new_blocks(c.seq_id, self.sequences[c.seq_id].num_tokens + 1)
                     for c in plan.chunks)
        o: FastServeOptions = self.options
        return reserve_blocks(o.reserved_blocks, growth, burst, self.kv.num_blocks,
                              o.max_reserve_fraction)

    def _select(self, plan: PlanBuilder, order: list[Sequence], enst: dict[str, float]) -> None:
        num_prompt_tokens = 0
        for index, seq in enumerate(order):
            if len(plan.chunks) >= self.batch.max_num_seqs:
                break
            if seq.seq_id in plan.preempted:
                continue  # it just lost its blocks to a higher-priority job
            num_tokens = seq.num_uncomputed_tokens
            is_prompt = num_tokens > 1
            if is_prompt and num_prompt_tokens and \
                    num_prompt_tokens + num_tokens > self.batch.max_num_batched_tokens:
                continue
            if not self._make_room(seq, num_tokens, order[index + 1:], enst, plan):
                continue  # not ready this iteration; a lower-priority job may still fit
            self._make_resident(seq, num_tokens, plan)
            plan.add(self.make_chunk(seq, num_tokens))  # its blocks were counted
            num_prompt_tokens += num_tokens if is_prompt else 0

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        if self.swap is not None and self.swap.is_swapped(seq.seq_id):
            return self.swap.num_device_blocks_to_resume(seq, self.kv, num_tokens)
        return self.kv.num_new_blocks(seq.seq_id, seq.num_computed_tokens + num_tokens)

    def _make_room(self, seq: Sequence, num_tokens: int, lower: list[Sequence],
                   enst: dict[str, float], plan: PlanBuilder) -> bool:
        """Evict resident jobs of lower priority, latest ENST first, until `seq` fits; evict
        nobody when even all of them would not free enough."""
        need = self._blocks_needed(seq, num_tokens)
        resident = [s for s in lower if s.status == SequenceStatus.RUNNING]
        if need > self.kv.num_free_blocks + sum(len(self.kv.table(s.seq_id)) for s in resident):
            return False
        resident.sort(key=lambda s: enst[s.seq_id])
        while need > self.kv.num_free_blocks:
            self._evict(resident.pop(), plan)
        return True

    def _make_resident(self, seq: Sequence, num_tokens: int, plan: PlanBuilder) -> None:
        if seq in self.swapped:
            self._try_swap_in(seq, num_tokens, plan)  # fits: _make_room counted its blocks
        elif seq.status != SequenceStatus.RUNNING:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _keep_reserve(self, plan: PlanBuilder, enst: dict[str, float]) -> None:
        """Proactive swap-out: keep the reserve free, evicting unselected resident jobs with the
        latest ENST (never by recompute: that would throw work away ahead of need)."""
        reserve = self.reserve
        selected = plan.seq_ids
        victims = sorted((s for s in self.running if s.seq_id not in selected),
                         key=lambda s: enst[s.seq_id], reverse=True)
        for victim in victims:
            if self.kv.num_free_blocks >= reserve:
                return
            if self.swap.can_swap_out(victim, self.kv) and self._evict(victim, plan):
                self.counts["proactive_swap_outs"] += 1

    def _swap_in_ahead(self, plan: PlanBuilder, enst: dict[str, float]) -> None:
        """Proactive swap-in: bring back swapped-out jobs, earliest ENST first, while the
        reserve stays free; a job swapped out in this plan stays out."""
        reserve = self.reserve
        for seq in sorted(self.swapped, key=lambda s: enst[s.seq_id]):
            if seq.seq_id in plan.preempted:
                continue
            need = self.swap.num_device_blocks_to_resume(seq, self.kv, 1)
            if self.kv.num_free_blocks - need < reserve or not self._try_swap_in(seq, 1, plan):
                return
            self.counts["proactive_swap_ins"] += 1

    # -- absorbing -------------------------------------------------------------------------------
    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> list[SequenceUpdate]:
        now = self.clock()
        updates = super().update_from_output(plan, output)
        for chunk in plan.chunks:
            seq = self.sequences.get(chunk.seq_id)
            if seq is not None:  # still running: charge it, maybe demote it
                self.mlfq.charge(seq.seq_id, self.profiler.iteration_s(chunk.num_tokens),
                                 self.profiler.iteration_s(seq.num_uncomputed_tokens), now)
        return updates
