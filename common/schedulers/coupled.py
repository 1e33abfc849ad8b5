"""Co-located (coupled) scheduling policies: prefill and decode share one instance.

`CoupledScheduler` is what every co-located policy is: the shared queues and preemption
(`queues.QueueScheduler`) plus the policy's own options and the questions the coupled role asks.
`make_coupled_scheduler` builds a policy by name from `COUPLED_POLICIES`, the registry filled from
the `splitserve.coupled_policies` entry points (pyproject.toml): a new policy is one module with
its `CoupledScheduler` subclass plus one line there.

`StallFreeScheduler` is Sarathi-Serve's stall-free batching (Alg. 3): every forward first takes
one token for each running decode, then continues partially prefilled prompts, then resumes
swapped-out sequences, then admits new prompts, all under one token budget
(`max_num_batched_tokens`); prompts are chunked to fit. Running decodes never wait for a whole
prompt. The other policies live in `baselines` (vllm, orca, chunked-only, hybrid-only),
`decode_maximal` and `fastserve`; docs/coupled.md describes them all.
"""

from __future__ import annotations

from dataclasses import fields
from typing import ClassVar

from common.block_pool import KVCacheManager
from common.config import BatchConfig
from common.plan import BatchPlan
from common.plugins import COUPLED_POLICIES
from common.schedulers.base import PlanBuilder
from common.schedulers.costs import IterationCosts
from common.schedulers.queues import QueueScheduler
from common.schedulers.swapping import SwapSpace
from common.sequence import Sequence


class CoupledScheduler(QueueScheduler):
    """A co-located policy: subclasses implement `schedule()` over a fresh `PlanBuilder`.

    `options_cls` names a policy's own options dataclass (None: the policy has none);
    `make_coupled_scheduler` builds it from a dict. A policy whose design assumes a host KV tier
    sets `wants_host_tier`, and the coupled role then gives it one by default. A policy that
    predicts forward times sets `wants_costs`, and the coupled role then hands it the profiled
    `IterationCosts` (common.schedulers.costs) as `costs` (None: no profile was found).
    """

    options_cls: ClassVar[type | None] = None
    wants_host_tier: ClassVar[bool] = False
    wants_costs: ClassVar[bool] = False

    def __init__(self, batch: BatchConfig, kv: KVCacheManager, swap: SwapSpace | None = None,
                 options: object | None = None, costs: IterationCosts | None = None) -> None:
        super().__init__(batch, kv, swap)
        self.options = options
        self.costs = costs

    def unstarted(self) -> list[Sequence]:
        """Waiting sequences with nothing computed or generated yet: they can run elsewhere."""
        return [s for s in self.waiting if s.num_computed_tokens == 0 and s.num_output_tokens == 0]


def make_coupled_scheduler(policy: str, batch: BatchConfig, kv: KVCacheManager,
                           swap: SwapSpace | None = None, options: dict | None = None,
                           costs: IterationCosts | None = None) -> CoupledScheduler:
    """The registered policy `policy`, with its options dataclass built from `options` (and the
    profiled costs, for a policy that `wants_costs`)."""
    cls = COUPLED_POLICIES.get(policy)
    if options and cls.options_cls is None:
        raise ValueError(f"coupled policy {policy!r} takes no options, got {sorted(options)}")
    extra = {"costs": costs} if cls.wants_costs else {}
    if cls.options_cls is None:
        return cls(batch, kv, swap, None, **extra)
    defaults = {f.name: f.default for f in fields(cls.options_cls)}
    unknown = set(options or {}) - set(defaults)
    if unknown:
        raise ValueError(f"unknown {policy} options {sorted(unknown)}; known: {sorted(defaults)}")
    # Values may come from the command line as numbers: cast each to its default's type
    # (8.0 -> 8 queues, 0.0 -> False).
    typed = {k: type(defaults[k])(v) for k, v in (options or {}).items()}
    return cls(batch, kv, swap, cls.options_cls(**typed), **extra)


class StallFreeScheduler(CoupledScheduler):
    """Entry points `sarathi` and `stall-free`."""

    def schedule(self) -> BatchPlan:
        plan = PlanBuilder()
        # 1. one token for every running decode; 2. continue partial prefills
        decodes_first = sorted(self.running, key=lambda s: not s.is_prefilled)
        budget = self._continue(plan, decodes_first, self.batch.max_num_batched_tokens)
        # 3. resume swapped-out sequences; 4. admit new prompts while budget, slots, blocks allow
        budget = self._resume_swapped(plan, budget)
        self._admit_chunked(plan, budget)
        return plan.build()
