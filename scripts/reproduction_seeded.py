"""Per-experiment tables of docs/reproduction.md from seeded reruns of the decode experiments:
E12 with three seeds and a predictor checked against its workload (for
scripts/reproduction_tables.py).

This module owns how `decode_intra_<host>/seed<N>/intra.json` files are read together; the
single-run E12 table of the first session stays in reproduction_experiments.py.
"""

from __future__ import annotations

import statistics

from reproduction_sources import NO_DATA, data_line, load, overlap, pct1, pm, spread, table

E12_SEEDS = (0, 1, 2)
E12_RERUN = "decode_intra_xeon"
E12_HEADER = ["lengths", "admission", "mean JCT (s), mean ± sd", "per seed (s)",
              "vs greedy, per seed", "vs greedy, verdict", "preemptions per seed"]


def intra_runs(name: str = E12_RERUN) -> list[dict] | None:
    """The committed seeds' intra.json (seed order), or None when there is none."""
    runs = [load(f"{name}/seed{seed}/intra.json") for seed in E12_SEEDS]
    return [r for r in runs if r is not None] or None


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def per_seed(runs: list[dict], field: str = "mean_jct_s") -> dict[tuple[str, str], list]:
    """(lengths, admission) -> the row's `field` on each seed."""
    values: dict[tuple[str, str], list] = {}
    for data in runs:
        for r in data["rows"]:
            values.setdefault((r["lengths"], r["admission"]), []).append(r[field])
    return values


def jct_spread(jct: dict[tuple[str, str], list[float]]) -> str:
    """'sd x-y% of the mean' of the runs' mean JCT over the seeds."""
    return spread([(statistics.mean(v), _sd(v)) for v in jct.values()])


def _verdict(values: list[float], greedy: list[float]) -> str:
    """Lower / higher on every seed with disjoint ranges, else not distinguishable."""
    if overlap(values, greedy):
        return "not distinguishable"
    return "lower on every seed" if max(values) < min(greedy) else "higher on every seed"


def e12_seeds(name: str = E12_RERUN) -> list[str]:
    runs = intra_runs(name)
    if runs is None:
        return table(E12_HEADER, [[NO_DATA, "", "", "", "", "", ""]])
    jct, preemptions = per_seed(runs), per_seed(runs, "preemptions")
    body = []
    for (lengths, admission), values in jct.items():
        # greedy ignores lengths: a run set without "predicted greedy" compares with true's
        greedy = jct.get((lengths, "greedy")) or jct["true", "greedy"]
        is_base = admission == "greedy"
        body.append([lengths, admission, pm(statistics.mean(values), _sd(values), 1),
                     ", ".join(f"{v:.1f}" for v in values),
                     "" if is_base else ", ".join(pct1(v, g) for v, g in zip(values, greedy)),
                     "" if is_base else _verdict(values, greedy),
                     ", ".join(map(str, preemptions[lengths, admission]))])
    return [*table(E12_HEADER, body), "", *_provenance(name, runs, jct)]


def _provenance(name: str, runs: list[dict], jct: dict) -> list[str]:
    errors = sum(sum(r["errors"].values()) for data in runs for r in data["rows"])
    checks = [data.get("predictor_overlap", {}) for data in runs]
    seen = [c.get("workload_prompts_seen") for c in checks]
    size = checks[0].get("dataset_prompts")
    noise = ("One greedy run per seed, the baseline of both series (greedy ignores lengths)"
             if ("predicted", "greedy") not in jct else
             "The two greedy runs of a seed ignore predictions: predicted-greedy vs true-greedy "
             "per seed " + ", ".join(pct1(p, t) for p, t in zip(jct["predicted", "greedy"],
                                                                jct["true", "greedy"]))
             + " (run-to-run noise)")
    check = (f"the predictor's dataset ({size:,} prompts) holds {max(seen)} of the "
             f"{runs[0]['options']['num_requests']} workload prompts on every seed "
             "(checked by the bench before each run)" if None not in seen and size
             else "the predictor was not checked against the workload")
    return [data_line([name], f"1 per policy and seed ({errors} failed requests)",
                      ", ".join(str(data["options"]["seed"]) for data in runs),
                      f"{jct_spread(jct)} over seeds (mean JCT)"), "",
            f"{noise}. Predictor: {check}."]


BUILDERS = {"E12-seeds": e12_seeds}
