"""The plan checks' table in docs/simulator.md, from their JSON: per candidate the simulated and
the real goodput per instance per seed (mean), SLO attainment, p99 TBT (ms) and mean JCT (s),
the real side's over its seeds' bench summaries.

    python docs/benchmarks/simulator_plan_check/zen1-13/table.py FILE.json ...
"""
import json
import statistics
import sys


def per_seed(values) -> str:
    return " / ".join(f"{v:.3f}" for v in values) + f" ({statistics.fmean(values):.3f})"


def real_row(real: dict) -> str:
    runs = real["runs"]

    def mean(path):
        return statistics.fmean(r["summary"][path[0]][path[1]] for r in runs)

    return (f"{per_seed([r['goodput_per_instance'] for r in runs])} | "
            f"{statistics.fmean(r['slo_attainment'] for r in runs):.0%} | "
            f"{mean(('tbt_s', 'p99')) * 1e3:.0f} | {mean(('jct_s', 'mean')):.1f}")


def rows(result: dict):
    real = {r["candidate"]: r for r in result["real"]}
    for i, sim in enumerate(result["simulated"]):
        name = sim["candidate"]
        tag = " (recommended)" if i == 0 else " (next)" if i == 1 else ""
        simulated = (f"{per_seed(sim['goodput_per_instance']['per_seed'])} | "
                     f"{sim['slo_attainment']:.0%} | {sim['tbt_p99_s'] * 1e3:.0f} | "
                     f"{sim['jct_mean_s']:.1f}")
        yield (f"| {name}{tag} | {simulated} | "
               f"{real_row(real[name]) if name in real else 'not run | | |'} |")


for path in sys.argv[1:]:
    result = json.load(open(path))
    print(f"{result['workload']}, {result['rate']:.3f} req/s, {result['instances']} instances on "
          f"{result.get('cores', 'own')} cores, TTFT <= {result['slo']['ttft_s']:g} s, TBT <= "
          f"{result['slo']['tbt_s']:g} s; simulated {result['simulated_verdict']}, real "
          f"{result['real_verdict']}: {'agrees' if result['agrees'] else 'disagrees'}")
    print("| candidate | simulated goodput | met | TBT p99 | JCT | real goodput | met | TBT p99 "
          "| JCT |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows(result):
        print(row)
    print()
