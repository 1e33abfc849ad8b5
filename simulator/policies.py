"""The one place the simulator builds the serving code's policy objects, from the same config
objects and registry names the instances and the gateway read.

Each function mirrors one line of a role or of the gateway (named in its docstring), so the
simulated cluster runs the classes a real one would load; tests/unit/simulator/
test_same_policies.py builds the real roles on fake contexts and fails if any class differs.
The two deliberate differences: the dispatcher gets a seed (the role leaves it unseeded, the
simulation must be reproducible), and FastServe reads the simulated clock (its `clock` seam).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from common.block_pool import KVCacheManager
from common.config import ConfigError, GatewayConfig, InstanceConfig, RoutingConfig
from common.plugins import COUPLED_POLICIES, DISPATCH_POLICIES, ROUTE_POLICIES
from common.schedulers.costs import token_budget_for_tbt
from common.schedulers.coupled import CoupledScheduler, make_coupled_scheduler
from common.schedulers.swapping import SwapSpace
from control_plane.cluster import InstanceRegistry
from control_plane.routing import LocalPrefillBudget, PrefixIndex, Router
from control_plane.transition import TransitionWatcher, make_watcher
from decode_instance.admission import AdmissionPolicy, make_admission
from decode_instance.scheduler import DecodeScheduler
from prefill_instance.dispatcher import Dispatcher, DispatchOptions
from prefill_instance.prediction import PrefillPredictor
from prefill_instance.scheduler import PrefillScheduler
from simulator.costs import PREFILL_SIZES, CostModel

DEFAULT_CHUNK_SIZE = 256  # prefill_instance.role.DEFAULT_CHUNK_SIZE (that module loads torch)


def chunk_size(config: InstanceConfig, costs: CostModel) -> int:
    """prefill_instance.role.chunk_size_for: configured, else the knee `splitserve profile`
    recorded (here: the cost model's), else the default."""
    return config.prefill.chunk_size or costs.recommended_chunk_size() or DEFAULT_CHUNK_SIZE


def prefill_scheduler(config: InstanceConfig, chunk: int, kv: KVCacheManager) -> PrefillScheduler:
    """PrefillRole: `PrefillScheduler(ctx.config.prefill, self.chunk_size, ctx.kv)`; its sort
    key comes from PREFILL_POLICIES inside."""
    return PrefillScheduler(config.prefill, chunk, kv)


def dispatcher(config: InstanceConfig, block_size: int, seed: int) -> Dispatcher:
    """PrefillRole: `DISPATCH_POLICIES.get(prefill.dispatch_policy)(DispatchOptions(prediction,
    block_size=...))`, seeded."""
    options = DispatchOptions(config.prediction, block_size=block_size, seed=seed)
    return DISPATCH_POLICIES.get(config.prefill.dispatch_policy)(options)


def predictor(config: InstanceConfig) -> PrefillPredictor:
    """PrefillRole: `PrefillPredictor(ctx.config.prediction)`. A trained predictor runs a model
    on the prompt's tokens or hidden states, which a simulation has not got: only the oracle
    (max_tokens as the true length) or none."""
    name = config.prediction.predictor
    if name not in (None, "oracle"):
        raise ConfigError(f"the simulator runs the 'oracle' length predictor or none, not a "
                          f"trained one ({name})")
    return PrefillPredictor(config.prediction)


def decode_scheduler(config: InstanceConfig, kv: KVCacheManager) -> DecodeScheduler:
    """DecodeRole: `DecodeScheduler(engine.batch, ctx.kv, self._swap_space())`, the host tier
    as many blocks as the device unless configured."""
    swap = None
    if config.decode.preempt == "swap":
        swap = SwapSpace(config.decode.swap_blocks or kv.num_blocks)
    return DecodeScheduler(config.engine.batch, kv, swap)


def admission(config: InstanceConfig) -> AdmissionPolicy:
    """DecodeRole: `make_admission(decode.admission, prediction)`."""
    return make_admission(config.decode.admission, config.prediction)


def host_blocks(config: InstanceConfig, num_device_blocks: int) -> int:
    """coupled_instance.role.CoupledSettings.num_host_blocks."""
    if config.coupled_swap_blocks is not None:
        return config.coupled_swap_blocks
    return num_device_blocks if COUPLED_POLICIES.get(config.coupled_policy).wants_host_tier else 0


def coupled_scheduler(config: InstanceConfig, kv: KVCacheManager, costs: CostModel,
                      clock: Callable[[], float]) -> CoupledScheduler:
    """coupled_instance.role.build_scheduler, with the cost model's curves where the role loads
    the profile record (`load_costs`) and the simulated clock for FastServe."""
    cls = COUPLED_POLICIES.get(config.coupled_policy)
    wants = cls.wants_costs or config.coupled_tbt_slo_s is not None
    curves = costs.iteration_costs() if wants else None
    batch = config.engine.batch
    if config.coupled_tbt_slo_s is not None:  # coupled_instance.role.budget_for_slo
        batch = replace(batch, max_num_batched_tokens=token_budget_for_tbt(
            curves, config.coupled_tbt_slo_s, batch.max_num_seqs))
    num_host = host_blocks(config, kv.num_blocks)
    swap = SwapSpace(num_host) if num_host > 0 else None
    scheduler = make_coupled_scheduler(config.coupled_policy, batch, kv, swap,
                                       dict(config.coupled_options), curves)
    if hasattr(scheduler, "clock"):
        scheduler.clock = clock  # FastServe: starvation and ENST in simulated seconds
    return scheduler


def local_prefill_budget(routing: RoutingConfig, costs: CostModel) -> int:
    """control_plane.routing.LocalPrefillBudget's auto budget: the largest profiled prefill
    within the TBT bound, from the rows the cost model was fitted to (the record the gateway
    would read), else from the model's own curve at the profile's sizes."""
    if routing.local_prefill == "off":
        return -1
    if routing.local_prefill == "on":
        return routing.local_prefill_tokens
    rows = [(r["tokens"], r["measured_s"]) for r in costs.fit.get("rows", [])
            if r["kind"] == "prefill"] or [(n, costs.prefill_s(n)) for n in PREFILL_SIZES]
    fits = [n for n, seconds in rows if seconds <= routing.local_prefill_tbt_s]
    return max(fits, default=routing.local_prefill_tokens)


def router(registry: InstanceRegistry, gateway: GatewayConfig, costs: CostModel) -> Router:
    """control_plane.routing.make_router."""
    routing, index = gateway.routing, PrefixIndex()
    policy = ROUTE_POLICIES.get(routing.policy)(routing, index)
    return Router(registry, routing, policy, index,
                  LocalPrefillBudget(routing, fixed=local_prefill_budget(routing, costs)))


def watcher(gateway: GatewayConfig) -> TransitionWatcher:
    """control_plane.gateway: `make_watcher(flip_policy, **dict(flip_options))`."""
    return make_watcher(gateway.flip_policy, **dict(gateway.flip_options))
