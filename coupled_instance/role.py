"""The coupled role: one instance serves requests end to end with a co-located policy.

admit -> schedule -> forward -> stream -> free:
1. Admit: a GenerateRequest becomes a Sequence in the policy's queues (a recovered request
   resumes with its already generated tokens counted as output).
2. Schedule and forward: the policy (`common.plugins.COUPLED_POLICIES`: vllm, orca, sarathi,
   chunked-only, hybrid-only, decode-maximal, fastserve) plans each forward; prefill and decode
   share this instance. With a host tier (`CoupledSettings.swap_blocks`), preemption swaps KV to
   host memory instead of recomputing, and FastServe swaps proactively.
3. Stream: every sampled token goes to the request's gateway as a TokenUpdate.
4. Free: blocks are released when the sequence finishes, is aborted or passes its deadline.

At start-up a policy that predicts forward times (FastServe's job profiler) or a TBT SLO (the
token budget chosen from it) gets the profiled costs (`common.schedulers.costs`): the record
`splitserve profile` left for this model, dtype and thread count, else a few seconds'
measurement on this instance's runner.

Draining for a flip: requests not started yet go back to the gateway as recoverable errors (it
runs them elsewhere); started ones finish here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from common.config import BatchConfig, ConfigError
from common.engine.role import Role, RoleContext
from common.engine.swap import attach_host_tier
from common.plan import BatchPlan, ModelOutput
from common.plugins import COUPLED_POLICIES
from common.profile_record import served_identity
from common.protocol import AbortRequest, GenerateRequest, KVTransferOffer, Message
from common.schedulers.costs import IterationCosts, recorded_costs, token_budget_for_tbt
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
    tbt_slo_s: float | None = None  # None: the configured token budget stands

    @classmethod
    def from_config(cls, config) -> CoupledSettings:
        return cls(policy=config.coupled_policy, swap_blocks=config.coupled_swap_blocks,
                   swap_bandwidth_bytes_per_s=config.coupled_swap_bandwidth,
                   policy_options=dict(config.coupled_options),
                   tbt_slo_s=getattr(config, "coupled_tbt_slo_s", None))

    def num_host_blocks(self, num_device_blocks: int) -> int:
        if self.swap_blocks is not None:
            return self.swap_blocks
        return num_device_blocks if COUPLED_POLICIES.get(self.policy).wants_host_tier else 0


def build_scheduler(ctx: RoleContext, settings: CoupledSettings) -> CoupledScheduler:
    """The policy's scheduler over the instance's block tables; attaches the host tier to the
    runner when the settings ask for one. An unknown policy fails, listing the known ones."""
    wants_costs = COUPLED_POLICIES.get(settings.policy).wants_costs
    costs = load_costs(ctx) if wants_costs or settings.tbt_slo_s is not None else None
    batch = budget_for_slo(ctx.config.engine.batch, settings.tbt_slo_s, costs)
    num_host_blocks = settings.num_host_blocks(ctx.kv.num_blocks)
    swap = None
    if num_host_blocks > 0:
        swap = SwapSpace(num_host_blocks)
        attach_host_tier(ctx.runner, num_host_blocks, settings.swap_bandwidth_bytes_per_s)
    return make_coupled_scheduler(settings.policy, batch, ctx.kv, swap, settings.policy_options,
                                  costs)


def load_costs(ctx: RoleContext) -> IterationCosts | None:
    """The served model's profiled costs: `splitserve profile`'s record when it was measured
    with this model, dtype and thread count, else a short measurement now, on the runner's
    still empty KV blocks. None (the policy falls back to constants and says so) when neither
    is possible."""
    runner = ctx.runner
    identity = served_identity(runner)
    if identity.model is None or identity.dtype is None:  # a runner without a model (role tests)
        return None
    costs = recorded_costs(ctx.config.engine.model.cache_dir, identity.model, identity.dtype,
                           identity.threads)
    if costs is not None:
        log.info("coupled role: forward costs from %s", costs.source)
        return costs
    from common.engine.profile import measure_costs  # torch: only when nothing is recorded

    started = time.perf_counter()
    try:
        # the median of three timings each: one timing moved FastServe's q1 across the short
        # prompts' prefill times from one process to the next (0 or 14 of 32 prompts in Q1)
        costs = measure_costs(runner, repeats=3)
    except ConfigError as exc:  # the KV pool holds too little to measure
        log.warning("coupled role: cannot measure forward costs (%s)", exc)
        return None
    log.info("coupled role: no profile recorded for %s; measured forward costs in %.1f s (run "
             "`splitserve profile` to record a full one)", identity,
             time.perf_counter() - started)
    return costs


def budget_for_slo(batch: BatchConfig, tbt_slo_s: float | None,
                   costs: IterationCosts | None) -> BatchConfig:
    """`batch` with the token budget the TBT SLO allows (Sarathi-Serve §4.3), or as it is
    without an SLO."""
    if tbt_slo_s is None:
        return batch
    if costs is None:
        raise ConfigError("--tbt-slo needs forward costs: run `splitserve profile` on this "
                          "machine with the served model")
    tokens = token_budget_for_tbt(costs, tbt_slo_s, batch.max_num_seqs)
    log.info("coupled role: TBT SLO %.1f ms gives a token budget of %d (%s)", tbt_slo_s * 1e3,
             tokens, costs.source)
    return replace(batch, max_num_batched_tokens=tokens)


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
            self.admit_guided(seq, self.scheduler.add)

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
                "num_queued_tokens": self.scheduler.num_queued_tokens,
                "policy_counters": self.scheduler.counters()}

    @property
    def is_drained(self) -> bool:
        return not self.scheduler.has_work and not self.compiling
