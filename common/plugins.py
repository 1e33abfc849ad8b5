"""The registry of every kind of plug-in, in one light module.

Each kind is filled from its pyproject entry-point group, so a new implementation is one module
plus one line under `[project.entry-points."splitserve.<group>"]` (then reinstall the project:
`pip install -e .`). Names are read without importing any implementation, so the CLI can check
and list them without loading torch or a role package; an implementation is imported the first
time its name is asked for.

    kind               group                           a name gives
    role               splitserve.roles                a Role class (common.engine.role)
    KV backend         splitserve.kv_backends          a KVTransferBackend (common.transfer)
    coupled policy     splitserve.coupled_policies     a CoupledScheduler (common.schedulers)
    prefill policy     splitserve.prefill_policies     a sort key for the prefill queue
    dispatch policy    splitserve.dispatch_policies    a Dispatcher (prefill_instance)
    admission policy   splitserve.admission_policies   an AdmissionPolicy (decode_instance)
    flip policy        splitserve.flip_policies        a FlipPolicy (control_plane.transition)
    predictor kind     splitserve.predictors           a LengthPredictor (length_predictor)
    route policy       splitserve.route_policies       a RoutePolicy (control_plane.routing)

Implementations are typed here only as `type` or `Callable`: their interfaces live in packages
that `common` must not import.
"""

from __future__ import annotations

from common.registry import Registry
from common.transfer import BACKENDS

ROLES: Registry[type] = Registry("role", group="splitserve.roles")
COUPLED_POLICIES: Registry[type] = Registry("coupled policy", group="splitserve.coupled_policies")
PREFILL_POLICIES: Registry = Registry("prefill policy", group="splitserve.prefill_policies")
DISPATCH_POLICIES: Registry[type] = Registry("dispatch policy",
                                             group="splitserve.dispatch_policies")
ADMISSION_POLICIES: Registry[type] = Registry("decode admission policy",
                                              group="splitserve.admission_policies")
FLIP_POLICIES: Registry[type] = Registry("flip policy", group="splitserve.flip_policies")
PREDICTORS: Registry[type] = Registry("length predictor kind", group="splitserve.predictors")
ROUTE_POLICIES: Registry[type] = Registry("route policy", group="splitserve.route_policies")

REGISTRIES: dict[str, Registry] = {
    "role": ROLES, "kv_backend": BACKENDS, "coupled_policy": COUPLED_POLICIES,
    "prefill_policy": PREFILL_POLICIES, "dispatch_policy": DISPATCH_POLICIES,
    "admission_policy": ADMISSION_POLICIES, "flip_policy": FLIP_POLICIES,
    "predictor": PREDICTORS, "route_policy": ROUTE_POLICIES,
}
