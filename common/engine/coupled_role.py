"""The coupled role: one instance serves requests end to end with a co-located policy.

admit -> schedule -> forward -> stream -> free:
1. Admit: a GenerateRequest becomes a Sequence in the policy's queues (a recovered request
   resumes with its already generated tokens counted as output).
2. Schedule and forward: the policy (`COUPLED_POLICIES`: vllm, orca, sarathi, chunked-only,
   hybrid-only, fastserve) plans each forward; prefill and decode share this instance. With a
   host tier (`CoupledSettings.swap_blocks`), preemption swaps KV to host memory instead of
   recomputing, and FastServe swaps proactively.
3. Stream: every sampled token goes to the request's gateway as a TokenUpdate.
4. Free: blocks are released when the sequence finishes, is aborted or passes its deadline.

Draining for a flip: requests not started yet go back to the gateway as recoverable errors (it
runs them elsewhere); started ones finish here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from common.engine.swap import HostSwapSpace
from common.engine.worker import Role, RoleContext
from common.plan import BatchPlan, ModelOutput
from common.protocol import (
    AbortRequest,
    GenerateRequest,
    KVTransferDone,
    KVTransferOffer,
    Message,
    TokenUpdate,
)
from common.schedulers.coupled import COUPLED_POLICIES, CoupledScheduler, make_coupled_scheduler
from common.schedulers.swapping import SwapSpace
from common.sequence import Sequence

log = logging.getLogger(__name__)
# Policies whose design assumes a host tier get one by default (as many blocks as the device).
SWAPPING_POLICIES = ("fastserve",)


@dataclass(frozen=True)
class CoupledSettings:
    """What the coupled role reads from `InstanceConfig` (fields named `coupled_*` there)."""

    policy: str = "sarathi"
    # Host blocks of the second KV tier: 0 = none (preempt by recompute); None = the policy's
    # default (as many as the device has for fastserve, else none).
    swap_blocks: int | None = None
    swap_bandwidth_bytes_per_s: float | None = None  # None = as fast as memcpy
    policy_options: dict = field(default_factory=dict)  # e.g. FastServeOptions fields

    @classmethod
    def from_config(cls, config) -> CoupledSettings:
        return cls(policy=config.coupled_policy, swap_blocks=config.coupled_swap_blocks,
                   swap_bandwidth_bytes_per_s=config.coupled_swap_bandwidth,
                   policy_options=dict(config.coupled_options))

    def num_host_blocks(self, num_device_blocks: int) -> int:
        if self.swap_blocks is not None:
            return self.swap_blocks
        return num_device_blocks if self.policy in SWAPPING_POLICIES else 0


def build_scheduler(ctx: RoleContext, settings: CoupledSettings) -> CoupledScheduler:
    """The policy's scheduler over the instance's block tables; attaches the host tier to the
    runner when the settings ask for one."""
    COUPLED_POLICIES.get(settings.policy)  # an unknown name fails here, listing the known ones
    num_host_blocks = settings.num_host_blocks(ctx.kv.num_blocks)
    swap = None
    if num_host_blocks > 0:
        swap = SwapSpace(num_host_blocks)
        runner = ctx.runner
        if runner.swap_space is None or runner.swap_space.num_blocks != num_host_blocks:
            runner.swap_space = HostSwapSpace(runner.kv_layout, num_host_blocks,
                                              settings.swap_bandwidth_bytes_per_s,
                                              pin_memory=runner.device.type == "cuda")
    return make_coupled_scheduler(settings.policy, ctx.config.engine.batch, ctx.kv, swap,
                                  settings.policy_options)


class CoupledRole(Role):
    name = "coupled"

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.settings = CoupledSettings.from_config(ctx.config)
        self.scheduler = build_scheduler(ctx, self.settings)
        log.info("coupled role: policy %s, %d host swap blocks", self.settings.policy,
                 self.scheduler.swap.num_blocks if self.scheduler.swap else 0)

    # -- messages --------------------------------------------------------------------------------
    def handle(self, message: Message) -> None:
        if isinstance(message, GenerateRequest):
            self._admit(message)
        elif isinstance(message, AbortRequest):
            self.scheduler.abort(message.request_id)
        elif isinstance(message, KVTransferOffer):  # meant for a decode instance
            self.ctx.send(message.source_inbox, KVTransferDone.rejected(
                message.request_id, "not a decode instance"))

    def _admit(self, request: GenerateRequest) -> None:
        num_prompt = len(request.prompt_token_ids) - request.num_generated
        seq = Sequence(request.request_id, request.prompt_token_ids[:num_prompt],
                       request.sampling, self.ctx.runner.max_model_len)
        seq.token_ids = list(request.prompt_token_ids)  # a recovered request resumes its output
        seq.extra.update(reply_to=request.reply_to, deadline=request.deadline)
        if self.draining:
            self._fail(seq, "instance is draining", recoverable=True)
        elif self.ctx.kv.num_blocks_for(seq.num_tokens + 1) > self.ctx.kv.num_blocks:
            self._fail(seq, "the prompt needs more KV blocks than this instance has")
        else:
            self.scheduler.add(seq)

    def _fail(self, seq: Sequence, error: str, recoverable: bool = False) -> None:
        self.ctx.emit(seq.extra["reply_to"], TokenUpdate(
            seq.seq_id, finish_reason="error", error=error, instance_id=self.ctx.instance_id,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            recoverable=recoverable))

    def begin_drain(self) -> None:
        super().begin_drain()
        for seq in list(self.scheduler.waiting):
            if seq.num_computed_tokens == 0 and seq.num_output_tokens == 0:
                self.scheduler.abort(seq.seq_id)  # nothing computed or sent: run it elsewhere
                self._fail(seq, "instance is draining", recoverable=True)

    # -- background work -------------------------------------------------------------------------
    def poll(self) -> None:
        wall_now = time.time()
        for seq in list(self.scheduler.sequences.values()):
            deadline = seq.extra.get("deadline", 0.0)
            if deadline and wall_now > deadline:
                self.scheduler.abort(seq.seq_id)
                self._fail(seq, "request deadline exceeded")

    # -- forwards --------------------------------------------------------------------------------
    def schedule(self) -> BatchPlan:
        return self.scheduler.schedule()

    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> None:
        reply_to = {c.seq_id: self.scheduler.sequences[c.seq_id].extra["reply_to"]
                    for c in plan.chunks if c.seq_id in self.scheduler.sequences}
        for u in self.scheduler.update_from_output(plan, output):
            self.ctx.emit(reply_to[u.seq_id], TokenUpdate(
                u.seq_id, u.new_token_ids, u.finish_reason, u.num_prompt_tokens,
                u.num_output_tokens, self.ctx.instance_id))

    # -- reporting -------------------------------------------------------------------------------
    def load(self) -> dict:
        sched = self.scheduler
        queued = sum(s.num_uncomputed_tokens for s in sched.waiting)
        queued += sum(s.num_uncomputed_tokens for s in sched.running if not s.is_prefilled)
        return {"num_waiting": len(sched.waiting) + len(sched.swapped),
                "num_running": len(sched.running), "num_transferring": 0,
                "num_queued_tokens": queued}

    def live_seq_ids(self) -> set[str]:
        return set(self.scheduler.sequences)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def is_drained(self) -> bool:
        return not self.scheduler.has_work
