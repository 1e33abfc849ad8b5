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
  4. proactive (options.proactive): swap out more resident, unselected jobs, latest ENST first,
     until `reserved_blocks` device blocks are free for arriving jobs (the burst reserve); then
     swap in swapped-out jobs, earliest ENST first, while that reserve stays free, so they are
     resident before they are scheduled. Reactive mode does only step 3.
After the forward each job that ran is charged its predicted iteration time (the cost model below)
and demoted when it used its quantum.

Cost model (FastServe's profiler; set the two rates from `splitserve profile`): a decode iteration
takes `seconds_per_decode_iteration` (this is also q1, the first quantum); a prompt of n tokens
takes max(q1, n * `seconds_per_prefill_token`). Charging predicted rather than measured times
keeps the schedule a pure function of the queues (golden-plan testable) and matches the paper's
quanta, counted in iterations of known length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.block_pool import KVCacheManager
from common.config import BatchConfig, ConfigError
from common.plan import BatchPlan, ModelOutput
from common.schedulers.base import PlanBuilder, SequenceUpdate
from common.schedulers.coupled import CoupledScheduler
from common.schedulers.mlfq import SkipJoinMLFQ
from common.schedulers.swapping import SwapSpace
from common.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class FastServeOptions:
    """FastServe's knobs; the defaults fit SmolLM2-135M in bfloat16 on the 2-core dev machine."""

    # q1 and the predicted time of one decode iteration (measured: 17 ms at batch 1, 55 at 32).
    seconds_per_decode_iteration: float = 0.02
    # Predicted prefill time per prompt token (measured: ~1300 prefill tokens/s at ChunkSize).
    seconds_per_prefill_token: float = 0.00075
    num_queues: int = 8  # n; the paper leaves it open (its example uses 4)
    # alpha: a job not run for this long returns to Q1 (the paper's default, "300 ms").
    starvation_limit_s: float = 0.3
    reserved_blocks: int = 0  # device blocks kept free for new jobs (proactive mode only)
    proactive: bool = True  # False: swap only when a selected job needs the blocks (reactive)
    skip_join: bool = True  # False: naive MLFQ, every job enters Q1 (FastServe's ablation)

    def __post_init__(self) -> None:
        if not (self.seconds_per_decode_iteration > 0 and self.seconds_per_prefill_token > 0
                and self.num_queues >= 1 and self.starvation_limit_s > 0
                and self.reserved_blocks >= 0):
            raise ConfigError(f"invalid FastServe options: {self}")

    def iteration_s(self, num_tokens: int) -> float:
        """Predicted time of a job's iteration that computes `num_tokens` tokens."""
        q1 = self.seconds_per_decode_iteration
        return q1 if num_tokens <= 1 else max(q1, num_tokens * self.seconds_per_prefill_token)


class FastServeScheduler(CoupledScheduler):
    """`running` holds the jobs whose KV is on the device, `swapped` those whose KV is on the
    host, `waiting` those with no KV yet (new, or dropped for recompute); the MLFQ alone orders
    them."""

    options_cls = FastServeOptions
    wants_host_tier = True  # proactive swapping is half of the design

    def __init__(self, batch: BatchConfig, kv: KVCacheManager, swap: SwapSpace | None = None,
                 options: FastServeOptions | None = None) -> None:
        super().__init__(batch, kv, swap, options or FastServeOptions())
        o: FastServeOptions = self.options
        self.mlfq = SkipJoinMLFQ(o.seconds_per_decode_iteration, o.num_queues,
                                 o.starvation_limit_s)
        self.clock = time.monotonic  # tests substitute a fake clock

    def add(self, seq: Sequence) -> None:
        super().add(seq)
        self.mlfq.join(seq.seq_id, self.options.iteration_s(seq.num_uncomputed_tokens),
                       self.clock(), self.options.skip_join)

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
        self._select(plan, order, enst)
        if self.options.proactive and self.swap is not None:
            self._keep_reserve(plan, enst)
            self._swap_in_ahead(plan, enst)
        return plan.build()

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
        """Proactive swap-out: keep `reserved_blocks` free, evicting unselected resident jobs
        with the latest ENST (never by recompute: that would throw work away ahead of need)."""
        reserve = self.options.reserved_blocks
        selected = plan.seq_ids
        victims = sorted((s for s in self.running if s.seq_id not in selected),
                         key=lambda s: enst[s.seq_id], reverse=True)
        for victim in victims:
            if self.kv.num_free_blocks >= reserve:
                return
            if self.swap.can_swap_out(victim, self.kv):
                self._evict(victim, plan)

    def _swap_in_ahead(self, plan: PlanBuilder, enst: dict[str, float]) -> None:
        """Proactive swap-in: bring back swapped-out jobs, earliest ENST first, while the
        reserve stays free; a job swapped out in this plan stays out."""
        reserve = self.options.reserved_blocks
        for seq in sorted(self.swapped, key=lambda s: enst[s.seq_id]):
            if seq.seq_id in plan.preempted:
                continue
            need = self.swap.num_device_blocks_to_resume(seq, self.kv, 1)
            if self.kv.num_free_blocks - need < reserve or not self._try_swap_in(seq, 1, plan):
                return

    # -- absorbing -------------------------------------------------------------------------------
    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> list[SequenceUpdate]:
        now = self.clock()
        updates = super().update_from_output(plan, output)
        for chunk in plan.chunks:
            seq = self.sequences.get(chunk.seq_id)
            if seq is not None:  # still running: charge it, maybe demote it
                self.mlfq.charge(seq.seq_id, self.options.iteration_s(chunk.num_tokens),
                                 self.options.iteration_s(seq.num_uncomputed_tokens), now)
        return updates
