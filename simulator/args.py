"""The flags `splitserve simulate` and `splitserve plan` add to those of `splitserve up` (light:
argparse only, read whenever the CLI builds its parser).

The cluster itself (instance counts, every policy, ChunkSize, KV blocks, transfer emulation,
the gateway's routing and flips) takes `splitserve up`'s own flags, so one command line
describes the same cluster to both.
"""

from __future__ import annotations

import argparse

WORKLOADS = ("synthetic", "sharegpt", "LPLD", "LPHD", "HPLD", "HPHD", "Mixed")
LINKS = ("roce-200g", "nvlink-300g", "ideal")  # simulator.costs.LINK_PRESETS


def add_simulate_args(parser: argparse.ArgumentParser) -> None:
    _cost_args(parser)
    _simulation_args(parser)
    _workload_args(parser)


def _cost_args(parser: argparse.ArgumentParser) -> None:
    costs = parser.add_argument_group("cost model (default: this machine's `splitserve profile` "
                                      "record in --cache-dir)")
    source = costs.add_mutually_exclusive_group()
    source.add_argument("--costs", metavar="FILE", help="a simulator cost model (JSON)")
    source.add_argument("--profile", metavar="FILE",
                        help="fit a `splitserve profile` record or report")
    source.add_argument("--hardware", metavar="NAME",
                        help="a cost model from published figures: h100-llama2-7b")
    costs.add_argument("--kv-bytes-per-token", type=int, default=None,
                       help="KV bytes per token of the profiled model, when fitting a model "
                            "the simulator does not know")
    costs.add_argument("--save-costs", metavar="FILE", help="write the cost model used")


# The simulated serving stack's own times, 0 unless measured (Layout checks they are >= 0).
_ZERO_SECONDS_FLAGS = (
    ("--message-latency", "delay of control messages (requests, offers, acknowledgements)"),
    ("--turn-overhead", "an instance loop's own work per forward, beside the forward (real "
                        "instances report it: GET /cluster forward_turn_seconds - busy_seconds "
                        "over num_forwards)"),
    ("--request-latency", "the serving stack's own latency per request beyond the forwards "
                          "(HTTP, tokenization, routing, the first token's way back; "
                          "simulator.request_path measures it)"),
    ("--wake", "extra time of a forward that starts when its instance had nothing to do "
               "(threads and caches waking up; simulator.calibrate measures it from a forward "
               "log)"),
    ("--handoff", "the KV hand-off's own time beyond the link, added to every transfer "
                  "(simulator.request_path.handoff reads it off forward logs)"),
    ("--handoff-per-token", "the KV hand-off's time per prompt token beyond the link's bytes "
                            "(measured with --handoff by simulator.request_path.handoff)"),
)


def _stack_time_args(group) -> None:
    for flag, help_text in _ZERO_SECONDS_FLAGS:
        group.add_argument(flag, type=float, default=0.0, metavar="SECONDS", help=help_text)


def stack_times(args: argparse.Namespace) -> dict[str, float]:
    """The Layout fields the stack-time flags set: each flag's name with `_s` (--wake: wake_s)."""
    names = [flag[2:].replace("-", "_") for flag, _ in _ZERO_SECONDS_FLAGS]
    return {f"{name}_s": getattr(args, name) for name in names}


def _core_args(group) -> None:
    group.add_argument("--shared-cores", type=int, default=None, metavar="N",
                       help="the instances share N cores (one machine): a forward slows while "
                            "more threads want a core than there are (simulator/cores.py; "
                            "steady decode off); default: each instance has its own hardware")
    group.add_argument("--core-threads", type=int, default=1, metavar="T",
                       help="with --shared-cores: threads each instance's forwards keep busy")


def core_sharing(args: argparse.Namespace) -> dict:
    """The Layout fields the core flags set (simulator.cluster.Layout checks them)."""
    return {"shared_cores": getattr(args, "shared_cores", None),
            "core_threads": getattr(args, "core_threads", 1)}


def _simulation_args(parser: argparse.ArgumentParser) -> None:
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--link", choices=LINKS, default=None,
                     help="KV link (default: --emulate-bandwidth if given, else the cost "
                          "model's)")
    _stack_time_args(sim)
    sim.add_argument("--flip-switch", type=float, default=0.01, metavar="SECONDS",
                     help="time a drained instance takes to switch roles")
    sim.add_argument("--plan-every-forward", action="store_true",
                     help="no steady-decode fast path (simulator/steady.py): the scheduler "
                          "plans every forward; the same result, several times slower")
    _core_args(sim)
    sim.add_argument("--slo-ttft", type=float, default=1.0, metavar="SECONDS")
    sim.add_argument("--slo-ttft-per-token", type=float, default=0.0, metavar="SECONDS",
                     help="goodput: added to the TTFT bound per prompt token")
    sim.add_argument("--slo-tbt", type=float, default=0.1, metavar="SECONDS",
                     help="goodput: p99 time between tokens")
    sim.add_argument("--cprofile", action="store_true",
                     help="also print where the simulator's own time goes (cProfile)")
    sim.add_argument("--out", default="results/simulate.json", help="JSON report path")


def _workload_args(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group("workload (as `splitserve bench`)")
    work.add_argument("--workload", choices=WORKLOADS, default="synthetic",
                      help="synthetic lengths (no dataset), the ShareGPT replay of `splitserve "
                           "bench`, or a TetriInfer class (default: %(default)s)")
    work.add_argument("--num-requests", type=int, default=200)
    work.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                      help="seconds of traffic: --rate x this many requests (synthetic)")
    work.add_argument("--rate", type=float, default=2.0, help="requests per second")
    work.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    work.add_argument("--cv", type=float, default=1.0, help="gamma arrivals' variation")
    work.add_argument("--workload-max-tokens", type=int, default=128,
                      help="sharegpt: output cap per request")
    work.add_argument("--workload-max-prompt-tokens", type=int, default=1024,
                      help="sharegpt: longest prompt")
    work.add_argument("--tokenizer", default=None,
                      help="model whose tokenizer counts tokens (default: --model)")
    work.add_argument("--prompt-median", type=float, default=256.0,
                      help="synthetic: median prompt tokens")
    work.add_argument("--output-median", type=float, default=128.0,
                      help="synthetic: median output tokens")


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """`splitserve plan`: the budget, the candidates, the workload, the SLOs, the cost model."""
    _cost_args(parser)
    plan = parser.add_argument_group("plan: candidates (comma-separated lists)")
    plan.add_argument("--instances", type=int, default=4, help="instance budget")
    plan.add_argument("--prefill-fractions", default="0.25,0.5,0.75",
                      help="disaggregated candidates: P = fraction x budget (rounded, 1..N-1); "
                           "'' for none")
    plan.add_argument("--policies", default="vllm,sarathi",
                      help="co-located candidates' policies; '' for none")
    plan.add_argument("--flip-policies", default=None,
                      help="disaggregated candidates' flip policies (default: --flip-policy)")
    plan.add_argument("--chunk-sizes", default=None,
                      help="ChunkSize candidates: prefill instances' chunk, a co-located "
                           "policy's token budget per iteration (default: --chunk-size, else "
                           "the cost model's)")
    plan.add_argument("--admissions", default=None,
                      help="decode admission candidates (default: --decode-admission)")
    plan.add_argument("--seeds", default="0", help="each candidate runs once per seed")
    plan.add_argument("--pools", metavar="FILE", default=None,
                      help="TetriInfer class pools (simulator/pools.py; default: the study's "
                           "committed file, else built into --cache-dir)")
    plan.add_argument("--json", action="store_true", help="print the result as JSON")
    _stack_time_args(parser.add_argument_group(
        "plan: the serving stack's own times in every candidate, as `simulate` takes them"))
    _core_args(parser.add_argument_group(
        "plan: one machine's cores shared by every candidate's instances, as `simulate` takes "
        "them (a budget of more instances than this machine's cores)"))
    plan.add_argument("--out", default=None, help="also write the JSON here")
    slo = parser.add_argument_group("plan: SLOs (goodput counts requests meeting both)")
    slo.add_argument("--slo-ttft", type=float, default=1.0, metavar="SECONDS")
    slo.add_argument("--slo-ttft-per-token", type=float, default=0.0, metavar="SECONDS",
                     help="added to the TTFT bound per prompt token")
    slo.add_argument("--slo-tbt", type=float, default=0.1, metavar="SECONDS",
                     help="p99 of a request's gaps between tokens")
    _workload_args(parser)
