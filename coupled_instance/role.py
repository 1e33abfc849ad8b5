"""The coupled role: one instance serves requests end to end with a co-located policy.

admit -> schedule -> forward -> stream -> free:
1. Admit: a GenerateRequest becomes a Sequence in the policy's queues (a recovered request
   resumes with its already generated tokens counted as output).
2. Schedule and forward: the policy (`common.plugins.COUPLED_POLICIES`: vllm, orca, sarathi,
   chunked-only, hybrid-only, fastserve) plans each forward; prefill and decode share this
   instance. With a host tier (`CoupledSettings.swap_blocks`), preemption swaps KV to host
   memory instead of recomputing, and FastServe swaps proactively.
3. Stream: every sampled token goes to the request's gateway as a TokenUpdate.
4. Free: blocks are released when the sequence finishes, is aborted or passes its deadline.

Draining for a flip: requests not started yet go back to the gateway as recoverable errors (it
runs them elsewhere); started ones finish here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from common.engine.role import Role, RoleContext
from common.engine.swap import attach_host_tier
from common.plan import BatchPlan, ModelOutput
from common.plugins import COUPLED_POLICIES
from common.protocol import AbortRequest, GenerateRequest, KVTransferOffer, Message
from common.schedulers.coupled import CoupledScheduler, make_coupled_scheduler
from common.schedulers.swapping import SwapSpace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoupledSettings:
    """What the coupled role reads from `InstanceConfig` (fields named `coupled_*` there)."""

    policy: str = "sarathi"
    # Host blocks of the second KV tier: 0 = none (preempt by recompute); None = the policy's
    # default (as many as the device has for a policy that `wants_host_tier`, else none).
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
        return num_device_blocks if COUPLED_POLICIES.get(self.policy).wants_host_tier else 0


def build_scheduler(ctx: RoleContext, settings: CoupledSettings) -> CoupledScheduler:
    """The policy's scheduler over the instance's block tables; attaches the host tier to the
    runner when the settings ask for one. An unknown policy fails, listing the known ones."""
    num_host_blocks = settings.num_host_blocks(ctx.kv.num_blocks)
    swap = None
    if num_host_blocks > 0:
        swap = SwapSpace(num_host_blocks)
        attach_host_tier(ctx.runner, num_host_blocks, settings.swap_bandwidth_bytes_per_s)
    return make_coupled_scheduler(settings.policy, ctx.config.engine.batch, ctx.kv, swap,
                                  settings.policy_options)


class CoupledRole(Role):
    name = "coupled"
    scheduler: CoupledScheduler

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.settings = CoupledSettings.from_config(ctx.config)
        self.scheduler = build_scheduler(ctx, self.settings)
        log.info("coupled role: policy %s, %d host swap blocks", self.settings.policy,
                 self.settings.num_host_blocks(ctx.kv.num_blocks))

    # -- messages --------------------------------------------------------------------------------
    def handle(self, message: Message) -> None:
        if isinstance(message, GenerateRequest):
            self._admit(message)
        elif isinstance(message, AbortRequest):
            self.discard(message.request_id, message.reason)
        elif isinstance(message, KVTransferOffer):  # meant for a decode instance
            self.refuse_offer(message)

    def _admit(self, request: GenerateRequest) -> None:
        seq = self.sequence_for(request)
        if self.draining:
            self.fail(seq, "instance is draining", recoverable=True)
        elif self.fits_or_fail(seq):
            self.scheduler.add(seq)

    def begin_drain(self) -> None:
        super().begin_drain()
        for seq in self.scheduler.unstarted():
            self.discard(seq.seq_id, "draining")  # nothing computed or sent: run it elsewhere
            self.fail(seq, "instance is draining", recoverable=True)

    # -- background work and forwards ------------------------------------------------------------
    def poll(self) -> None:
        self.expire_deadlines()

    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> None:
        self.stream(plan, output)

    # -- reporting -------------------------------------------------------------------------------
    def load(self) -> dict:
        return {"num_waiting": self.scheduler.num_waiting,
                "num_running": self.scheduler.num_running, "num_transferring": 0,
                "num_queued_tokens": self.scheduler.num_queued_tokens}

    @property
    def is_drained(self) -> bool:
        return not self.scheduler.has_work
