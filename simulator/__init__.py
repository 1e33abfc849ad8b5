"""`splitserve simulate`: a discrete-event simulation of a whole splitserve cluster.

The serving code's own policy objects (prefill scheduler and its sort key, dispatcher and its
placement table, decode scheduler and admission policy, co-located schedulers, route policy,
transition watcher) run unchanged against simulated time; only the forward pass (a cost model
fitted from `splitserve profile`, `costs`) and the KV links (latency + bytes / bandwidth) are
modelled. docs/simulator.md describes what is modelled and what is not.

    costs      the cost model: forward time of a plan, transfer time over a link; JSON files
    hardware   cost models from published figures (labelled as such)
    policies   the one place the simulator builds policy objects, by the instances' own names
    engine     the event loop and its simulated clock
    instances  the instance loop (plan, forward, absorb) and the role objects it hosts
    cluster    gateway routing, the monitor's views and flips, per-request traces
    workload   what requests arrive when (synthetic, or the workloads of `splitserve bench`)
    metrics    traces -> the metrics dict `splitserve bench` reports
    run        one simulation: (layout, costs, workload, seed) -> metrics
    speed      simulated seconds per wall second on a large configuration
    pools      TetriInfer class lengths tokenized once, resampled for long simulations
    plan       candidate layouts for an instance budget, ranked by goodput per instance
    plan_cli   `splitserve plan`: flags, workloads per seed, the table and JSON
    study      the at-scale crossover study (python -m simulator.study)
    study_plot its figure and crossover table
    validate   real runs against simulated ones (python -m simulator.validate)

Only the CLI (control_plane/cli.py, in its handlers) imports this package; study and validate
run as modules.
"""
