"""A simulated instance: the instance worker's loop (common/engine/worker.py) in simulated time.

Each turn of the loop, as in the real worker: hand every message that arrived to the active role,
let the role poll (dispatch, admission, ...), take its plan; if the plan is empty the instance
idles until the next message. Otherwise the forward "runs" for the cost model's time of that
plan, and at its end the role absorbs a `ModelOutput` whose sampled tokens come from the
workload: EOS at the request's true output length, a filler token before. Messages that arrive
during a forward wait for the next turn, as they wait in the real inbox.

A flip (common/engine/worker.py's FlipCommand): the role drains; once it holds nothing the
instance spends `flip_switch_s` switching and comes back with the other role's object over the
same block pool, as the real worker swaps the role in place.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from common.block_pool import KVCacheManager
from common.config import InstanceConfig
from common.plan import BatchPlan, ForwardShape, ModelOutput
from common.protocol import InstanceStats
from simulator import steady
from simulator.roles import ROLES, SimRole
from simulator.workload import EOS_TOKEN, FILLER_TOKEN

GATEWAY = "sim-gateway"  # the one gateway's inbox, as InstanceStats.requests_seen names it

if TYPE_CHECKING:
    from simulator.cluster import SimCluster


class SimInstance:
    def __init__(self, cluster: SimCluster, instance_id: str, role: str, config: InstanceConfig,
                 kv: KVCacheManager, seed: int) -> None:
        self.cluster, self.loop, self.costs = cluster, cluster.loop, cluster.costs
        self.instance_id, self.config, self.kv, self.seed = instance_id, config, kv, seed
        self.max_model_len = cluster.max_model_len
        self.inbox: deque[tuple[str, object]] = deque()
        self.busy = False  # a forward (or a role switch) is in flight
        self.idle = True  # the last turn found nothing to do: the next forward wakes it up
        self._turn_due = False
        self.busy_seconds = 0.0
        self.computed_tokens = 0
        self.requests_seen = 0  # "generate" messages handled (the worker's requests_seen)
        self.num_forwards = 0
        # (shape, seconds) of each forward, with Layout.record_forwards
        self.forwards: list[tuple[ForwardShape, float]] | None = (
            [] if cluster.layout.record_forwards else None)
        self.flip_target = ""  # draining for a flip to this role
        self.link_free_at = 0.0  # when the KV link into this instance is free again
        self.role: SimRole = ROLES[role](self)
        self.steady_decode = cluster.layout.steady_decode and cluster.cores is None
        self.leap: steady.Leap | None = None  # steady decode forwards in flight

    # -- the loop ------------------------------------------------------------------------------
    def deliver(self, kind: str, payload: object) -> None:
        """A message arrives; an idle instance takes a turn now (after every message due at this
        same moment has arrived, as the real loop drains its inbox before planning)."""
        self.inbox.append((kind, payload))
        if self.leap is not None:
            self._cut_leap()
        if not self.busy and not self._turn_due:
            self._turn_due = True
            self.loop.at(self.loop.now, self.turn)

    def turn(self) -> None:
        self._turn_due = False
        while self.inbox:
            kind, payload = self.inbox.popleft()
            self.requests_seen += kind == "generate"
            self.role.handle(kind, payload)
        self.role.poll()
        if self.steady_decode and self.role.name == "decode":
            step = steady.steady_batch(self.role.scheduler)
            if step is not None:
                self.leap = steady.Leap(self, *step, self.cluster.layout.leap_steps,
                                        self._wake_s(None))
                self.busy = True
                self.loop.at(self.leap.end, self._leap_done, self.leap, 0)
                return
        plan = self.role.schedule()
        if plan.is_empty:
            self.busy, self.idle = False, True
            if self.flip_target and self.role.is_drained:
                self._switch()
            return
        seconds = self.costs.forward_s(plan, self.kv.block_size) + self._wake_s(plan)
        self.busy = True
        if self.cluster.cores is None:
            self.loop.after(seconds + self.cluster.layout.turn_overhead_s, self._forward_done,
                            plan, seconds)
        else:
            self.cluster.cores.start(self, seconds, lambda wall: self.loop.after(
                self.cluster.layout.turn_overhead_s, self._forward_done, plan, wall))

    def _wake_s(self, plan: BatchPlan | None) -> float:
        """`Layout.wake_s` for the first forward after the instance had nothing to do
        (`Layout.wake_prompt_s` when that forward, `plan`, carries a prompt chunk; None: a
        steady leap's decode steps). The plan's shape is worked out only for such a forward."""
        woke, self.idle = self.idle, False
        if not woke:
            return 0.0
        layout = self.cluster.layout
        if plan is None or layout.wake_prompt_s is None or plan.shape().kind == "decode":
            return layout.wake_s
        return layout.wake_prompt_s

    def _forward_done(self, plan: BatchPlan, seconds: float) -> None:
        self.busy_seconds += seconds
        self.computed_tokens += plan.num_tokens - plan.num_padding_tokens
        self.num_forwards += 1
        if self.forwards is not None:
            self.forwards.append((plan.shape(), seconds))
        self.role.absorb(plan, self.sampled(plan))
        self.turn()

    def _leap_done(self, leap: steady.Leap, ticket: int) -> None:
        """The last forward of a steady leap ended (an event of a leap cut short since is
        stale)."""
        if leap is not self.leap or ticket != leap.ticket:
            return
        leap.catch_up(self.loop.now)
        self.leap = None
        self.turn()

    def _cut_leap(self) -> None:
        """A message arrived during a leap: it ends after the forward in flight."""
        leap = self.leap
        end = leap.end
        leap.cut(self.loop.now)
        if leap.end != end:
            leap.ticket += 1
            self.loop.at(leap.end, self._leap_done, leap, leap.ticket)

    def sampled(self, plan: BatchPlan) -> ModelOutput:
        """What the sampler returns: EOS for a request's last token, a filler token before."""
        lengths = self.cluster.output_lengths
        tokens = {c.seq_id: EOS_TOKEN if c.num_output_tokens + 1 >= lengths[c.seq_id]
                  else FILLER_TOKEN for c in plan.chunks if c.sampling is not None}
        return ModelOutput(tokens)

    # -- flips ---------------------------------------------------------------------------------
    def begin_flip(self, target_role: str) -> None:
        self.flip_target = target_role
        if self.leap is not None:  # the real loop reads its FlipCommand after the forward
            self._cut_leap()
        self.role.begin_drain()
        if not self.busy and not self._turn_due:
            self._turn_due = True
            self.loop.at(self.loop.now, self.turn)

    def _switch(self) -> None:
        """Drained: the other role takes over after the switch time; no turn meanwhile."""
        self.busy = True
        self.loop.after(self.cluster.layout.flip_switch_s, self._switched)

    def _switched(self) -> None:
        self.role = ROLES[self.flip_target](self)
        self.flip_target = ""
        self.busy = False
        self.cluster.flip_done(self)
        self.turn()

    # -- reports -------------------------------------------------------------------------------
    def stats(self) -> InstanceStats:
        """The load report the worker sends every report interval (common/engine/worker.py)."""
        if self.leap is not None:
            self.leap.catch_up(self.loop.now)
        kv = self.kv
        return InstanceStats(
            instance_id=self.instance_id, role=self.role.name, inbox=self.instance_id,
            kv_endpoint=self.instance_id, model="simulated", max_model_len=self.max_model_len,
            num_total_blocks=kv.num_blocks, num_free_blocks=kv.num_free_blocks,
            busy_seconds=self.busy_seconds, num_computed_tokens=self.computed_tokens,
            timestamp=self.loop.now, draining=bool(self.flip_target),
            requests_seen={GATEWAY: self.requests_seen}, **self.role.load())
