"""Regenerate the tables of docs/reproduction.md from the committed JSON under docs/benchmarks/.

This script owns the marked regions of docs/reproduction.md: each `<!-- generated:NAME -->` ...
`<!-- end generated -->` block is rebuilt from the data by the builder named NAME (the prose
around them is hand-kept). Every generated table ends with where its numbers came from: the data
directories, the CPU kind they ran on, the number of runs, the seeds and the spread over seeds.
A result whose JSON is not committed reads "no committed data", never a remembered number.

    python scripts/reproduction_tables.py           # rewrite the regions in place
    python scripts/reproduction_tables.py --check   # exit 1 if the file and the data disagree

tests/unit/docs/test_reproduction_tables.py runs the check. Which data each table reads, and the
paper's numbers it is compared with, are in the builders below and in reproduction_experiments.py.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# scripts/ is not a package: make the sibling modules importable however this file is loaded.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import reproduction_experiments as experiments  # noqa: E402
import reproduction_glance as glance  # noqa: E402
import reproduction_seeded as seeded  # noqa: E402
from reproduction_sources import (NO_DATA, ROOT, Compare, compare, data_line, pm,  # noqa: E402
                                  seeds_text, spread, spread_over, table)

DOC = ROOT / "docs" / "reproduction.md"
REGION = re.compile(r"(<!-- generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)",
                    re.DOTALL)


@dataclass(frozen=True)
class Col:
    header: str
    metric: str  # a key of compare.json's results, e.g. "TTFT p99"
    digits: int = 0
    scale: float = 1.0  # e.g. 1e-3 for ms -> s
    sd: bool = True  # "mean ± sd" or the mean alone


def compare_rows(rows: list[tuple[str, Compare | None, str]], cols: list[Col]) -> list[list]:
    """One table row per (label, run, system); a run or system not committed says so."""
    out = []
    for label, run, system in rows:
        if run is None or not run.has(system):
            out.append([label, NO_DATA, *[""] * (len(cols) - 1)])
            continue
        cells = []
        for c in cols:
            mean, sd = run.mean(system, c.metric) * c.scale, run.std(system, c.metric) * c.scale
            cells.append(pm(mean, sd, c.digits) if c.sd else f"{mean:,.{c.digits}f}")
        out.append([label, *cells])
    return out


def compare_region(first: str, rows: list[tuple[str, str, str]], cols: list[Col],
                   spread_metric: str) -> list[str]:
    """A table of compare runs: rows are (label, data directory, system)."""
    runs = {name: compare(name) for _, name, _ in rows}
    body = compare_rows([(label, runs[name], system) for label, name, system in rows], cols)
    present = [r for r in runs.values() if r is not None]
    pairs = [(r.mean(s, spread_metric), r.std(s, spread_metric)) for _, n, s in rows
             if (r := runs[n]) is not None and r.has(s)]
    names = list(runs)
    note = data_line(names, f"{len(present)} of {len(names)} committed" if len(present) < len(names)
                     else str(len(names)), seeds_text(present),
                     f"{spread(pairs)} ({spread_metric})" if pairs else NO_DATA)
    return [*table([first, *[c.header for c in cols]], body), "", note]


# -- vLLM CPU against splitserve -------------------------------------------------------------------
FULL = [Col("TTFT mean (ms)", "TTFT mean"), Col("TTFT p50", "TTFT p50", 1),
        Col("TTFT p99", "TTFT p99"), Col("TPOT p50 (ms)", "TPOT p50", 1),
        Col("TPOT p99", "TPOT p99", 1), Col("JCT mean (ms)", "JCT mean"),
        Col("output tok/s", "output tok/s", 1)]
WITH_TBT = [*FULL[:5], Col("TBT p99", "TBT p99"), *FULL[5:]]
NO_MEAN = [c for c in WITH_TBT if c.metric != "TTFT mean"]
SPLITSERVE = {"disagg": "splitserve disagg (1P+1D)", "sarathi": "splitserve sarathi (co-located)",
              "vllm-cpu": "vLLM CPU"}


def vllm_s2() -> list[str]:
    rows = [(SPLITSERVE[s], "compare_vllm_cpu", s) for s in ("disagg", "sarathi", "vllm-cpu")]
    return compare_region("system (run 1)", rows, FULL, "TTFT p99")


def vllm_s2_budget() -> list[str]:
    rows = [("sarathi, budget 1024", "compare_vllm_cpu_budget", "sarathi-1024"),
            ("sarathi, budget 2048", "compare_vllm_cpu_budget", "sarathi-2048"),
            ("vLLM CPU", "compare_vllm_cpu_budget", "vllm-cpu")]
    return compare_region("system (run 2)", rows, FULL[1:], "TTFT p99")


def vllm_s5() -> list[str]:
    rows = [(f"{n} {label}", f"compare_vllm_cpu_zen4_s5_run{n}", system)
            for n in range(1, 5) for system, label in (("sarathi", "splitserve sarathi"),
                                                       ("vllm-cpu", "vLLM CPU"))]
    return compare_region("run, system", rows, NO_MEAN, "TTFT p99")


def vllm_s5_seeds() -> list[str]:
    """Per seed: TTFT p99 / TPOT p99 (ms) / output tok/s."""
    def seeds(run: Compare | None, system: str) -> str:
        if run is None or not run.has(system):
            return NO_DATA
        return ", ".join(f"{r['ttft_s']['p99'] * 1e3:.0f} / {r['tpot_s']['p99'] * 1e3:.1f} / "
                         f"{r['throughput']['output_tokens_per_s']:.1f}" for r in run.runs(system))
    runs = [compare(f"compare_vllm_cpu_zen4_s5_run{n}") for n in range(1, 5)]
    body = [[n, seeds(run, "sarathi"), seeds(run, "vllm-cpu")] for n, run in enumerate(runs, 1)]
    return table(["run", "splitserve sarathi, seeds 0 / 1 / 2", "vLLM CPU, seeds 0 / 1 / 2"], body)


def vllm_s4() -> list[str]:
    rows = [(SPLITSERVE[s], "compare_vllm_cpu_zen4_s4", s) for s in ("sarathi", "disagg")]
    rows.append(("vLLM CPU 0.32.0", "compare_vllm_cpu_zen4_s4", "vllm-cpu"))
    return compare_region("system", rows, WITH_TBT, "TTFT p99")


def vllm_s4_rerun() -> list[str]:
    rows = [("sarathi (budget 512)", "compare_vllm_cpu_zen4_s4_rerun", "sarathi"),
            ("sarathi, budget 1,024", "compare_vllm_cpu_zen4_s4_rerun", "sarathi-1024"),
            ("vLLM CPU", "compare_vllm_cpu_zen4_s4_rerun", "vllm-cpu")]
    return compare_region("system (run 2)", rows, NO_MEAN, "TTFT p99")


def vllm_avx2() -> list[str]:
    rows = [("splitserve sarathi, before the skinny kernel", "compare_vllm_cpu_avx2", "sarathi"),
            ("splitserve sarathi, with it", "compare_vllm_cpu_avx2_skinny", "sarathi"),
            ("splitserve disagg, with it", "compare_vllm_cpu_avx2_skinny", "disagg"),
            ("vLLM CPU 0.32.0 (float32)", "compare_vllm_cpu_avx2", "vllm-cpu")]
    return compare_region("system", rows, FULL, "TTFT p99")


# -- the scheduling experiments --------------------------------------------------------------------
ABLATION = {"chunked-only": "chunked-prefills-only", "hybrid-only": "hybrid-batching-only",
            "sarathi": "Sarathi-Serve (both)"}
ABLATION_COLS = [Col("TTFT p50 (ms)", "TTFT p50"), Col("TTFT mean", "TTFT mean"),
                 Col("P99 TBT (ms)", "TBT p99"), Col("TPOT p50", "TPOT p50", 1),
                 Col("JCT mean (s)", "JCT mean", 2, 1e-3), Col("output tok/s", "output tok/s", 1)]


def e7() -> list[str]:
    # chunked-only's row is the clean rerun: the first run lost 33 of its requests (see below)
    rows = [(ABLATION[s], "compare_sarathi_ablation_rerun" if s == "chunked-only"
             else "compare_sarathi_ablation", s) for s in ABLATION]
    return compare_region("scheduler", rows, ABLATION_COLS, "TBT p99")


def e7_after() -> list[str]:
    cols = [Col("2 req/s: TTFT mean (ms)", "TTFT mean"), Col("P99 TBT", "TBT p99", 1),
            Col("JCT mean (s)", "JCT mean", 2, 1e-3)]
    slow = compare_rows([(ABLATION[s], compare("compare_sarathi_ablation_after_kernels"), s)
                         for s in ABLATION], cols)
    fast_cols = [Col("4 req/s: TTFT mean", "TTFT mean", 1), Col("P99 TBT", "TBT p99"),
                 Col("TPOT p50", "TPOT p50", 1, sd=False),
                 Col("JCT mean", "JCT mean", 2, 1e-3, sd=False)]
    fast = compare_rows([(ABLATION[s], compare("compare_sarathi_ablation_rate4"), s)
                         for s in ABLATION], fast_cols)
    body = [a + b[1:] for a, b in zip(slow, fast)]
    runs = [r for r in (compare("compare_sarathi_ablation_after_kernels"),
                        compare("compare_sarathi_ablation_rate4")) if r is not None]
    names = ["compare_sarathi_ablation_after_kernels", "compare_sarathi_ablation_rate4"]
    header = ["scheduler", *[c.header for c in cols], *[c.header for c in fast_cols]]
    return [*table(header, body), "", data_line(names, str(len(runs)), seeds_text(runs),
                                                f"{spread_over(runs, ABLATION, 'TBT p99')} "
                                                "(TBT p99)")]


def e7_hphd() -> list[str]:
    cols = [*ABLATION_COLS[:3], *[Col(c.header, c.metric, c.digits, c.scale, sd=False)
                                  for c in ABLATION_COLS[3:]]]
    rows = [(ABLATION[s], "compare_sarathi_ablation_hphd", s) for s in ABLATION]
    return compare_region("scheduler", rows, cols, "TBT p99")


def e7_budget1024() -> list[str]:
    rows = [(ABLATION[s], "compare_sarathi_ablation_budget1024", s) for s in ABLATION]
    return compare_region("scheduler", rows, ABLATION_COLS, "TBT p99")


FASTSERVE = {"vllm": "vllm (FCFS)", "fastserve-naive": "fastserve-naive",
             "fastserve": "fastserve (skip-join)"}
FASTSERVE_COLS = [Col("norm. latency mean (ms/token)", "norm. latency mean", 1),
                  Col("norm. latency p95", "norm. latency p95", 1),
                  Col("TTFT mean (ms)", "TTFT mean"),
                  Col("JCT mean (s)", "JCT mean", 2, 1e-3), Col("output tok/s", "output tok/s", 1)]


def e17() -> list[str]:
    rows = [(label, "compare_fastserve", s) for s, label in FASTSERVE.items()]
    return compare_region("system", rows, FASTSERVE_COLS, "norm. latency mean")


def e17_rate5() -> list[str]:
    rows = [(label, "compare_fastserve_rate5", s) for s, label in FASTSERVE.items()]
    return compare_region("system", rows, FASTSERVE_COLS, "norm. latency mean")


E17_MODES = (("", "greedy"), ("_sampled", "sampled"))


def e17_b8(host: str, rate: int) -> list[str]:
    """E17 as published (proactive swap, profiled job-profiler costs) with 8 batch slots, greedy
    and sampled, and what the policies did (their counters over each seed's run)."""
    names = [f"compare_fastserve_{host}_rate{rate}_b8{suffix}" for suffix, _ in E17_MODES]
    rows = [(f"{label}, {mode}", name, s) for name, (_, mode) in zip(names, E17_MODES)
            for s, label in FASTSERVE.items()]
    lines = compare_region("system", rows, FASTSERVE_COLS, "norm. latency mean")
    counters = []
    for name, (_, mode) in zip(names, E17_MODES):
        run = compare(name)
        for system, label in FASTSERVE.items():
            if run is None or not run.has(system):
                continue
            totals = [(r.get("policy") or {}).get("total", {}) for r in run.runs(system)]
            counters.append([f"{label}, {mode}", *[" / ".join(str(t.get(key, 0)) for t in totals)
                                                   for key in E17_COUNTERS]])
    if counters:
        lines += ["", *table(["policy counters per seed (0 / 1 / 2)", *E17_COUNTERS], counters)]
    return lines


E17_COUNTERS = ("entered_q1", "promotions", "demotions", "preemptions", "swap_outs",
                "proactive_swap_outs", "recomputes")


PHASE = {"static-2P1D": "static 2P+1D", "flips-2P1D": "2P+1D with load-ratio flips"}
PHASE_COLS = [Col("TTFT mean (ms)", "TTFT mean"), Col("TTFT p99", "TTFT p99"),
              Col("TPOT p50 (ms)", "TPOT p50", 1), Col("TBT p99", "TBT p99"),
              Col("JCT mean (s)", "JCT mean", 2, 1e-3), Col("output tok/s", "output tok/s", 1)]


PHASE_MIGRATE = {**PHASE, "flips-migrate-2P1D": "2P+1D, flips that migrate decodes"}


def e16(name: str = "compare_phase_shift", layouts: dict[str, str] = PHASE) -> list[str]:
    rows = [(label, name, s) for s, label in layouts.items()]
    lines = compare_region("layout", rows, PHASE_COLS, "JCT mean")
    run = compare(name)
    if run is not None and all(run.has(s) for s in layouts):
        def per_seed(text) -> str:
            return "; ".join(f"{layouts[s]}: " + ", ".join(text(r) for r in run.runs(s))
                             for s in layouts)
        flips = per_seed(lambda r: str(len(r.get("flips", []))))
        jct = per_seed(lambda r: f"{r['jct_s']['mean']:.1f}")
        lines += ["", f"Flips per seed: {flips}. JCT mean per seed (s): {jct}."]
        if any(f.get("num_migrated", 0) for s in layouts for r in run.runs(s)
               for f in r.get("flips", [])):
            lines += ["", "Flips back to prefill, per layout and seed (drain s / sequences "
                      "migrated): " + per_seed(lambda r: " ".join(
                          f"{f['drain_seconds']:.1f}/{f.get('num_migrated', 0)}"
                          for f in r.get("flips", []) if f["from_role"] == "decode") or "-")
                      + "."]
    return lines


BUILDERS = {
    "glance": glance.build, "hosts": glance.hosts,
    "vllm-s2": vllm_s2, "vllm-s2-budget": vllm_s2_budget, "vllm-s5": vllm_s5,
    "vllm-s5-seeds": vllm_s5_seeds, "vllm-s4": vllm_s4, "vllm-s4-rerun": vllm_s4_rerun,
    "vllm-avx2": vllm_avx2, "E7": e7, "E7-after": e7_after, "E7-hphd": e7_hphd,
    "E7-1024": e7_budget1024,
    "E17": e17, "E17-rate5": e17_rate5, "E16": e16,
    "E17-zen3-rate5": lambda: e17_b8("zen3", 5),
    "E17-zen4-rate5": lambda: e17_b8("zen4", 5), "E17-zen4-rate10": lambda: e17_b8("zen4", 10),
    "E16-xeon": lambda: e16("compare_phase_shift_xeon"),
    "E16-xeon-sampled": lambda: e16("compare_phase_shift_xeon_sampled"),
    "E16-zen3-migrate": lambda: e16("compare_phase_shift_zen3_migrate", PHASE_MIGRATE),
    "E16-zen3-migrate-sampled": lambda: e16("compare_phase_shift_zen3_migrate_sampled",
                                            PHASE_MIGRATE),
    **experiments.BUILDERS,
    **seeded.BUILDERS,
}


# -- the document ----------------------------------------------------------------------------------
def render(text: str) -> str:
    """`text` with every marked region rebuilt; an unknown region name is an error."""
    def rebuild(match: re.Match) -> str:
        name = match.group("name")
        if name not in BUILDERS:
            raise KeyError(f"docs/reproduction.md marks a region {name!r} that no builder makes; "
                           f"known: {', '.join(sorted(BUILDERS))}")
        # blank lines inside the markers: a table must not run into the comment lines
        return match.group(1) + "\n" + "\n".join(BUILDERS[name]()) + "\n\n" + match.group(4)
    return REGION.sub(rebuild, text)


def regions(text: str) -> list[str]:
    return [m.group("name") for m in REGION.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only compare: exit 1 when the file differs from the data")
    parser.add_argument("--doc", type=Path, default=DOC)
    args = parser.parse_args(argv)
    text = args.doc.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{args.doc}: tables differ from the data; run scripts/reproduction_tables.py")
            return 1
        print(f"{args.doc}: {len(regions(text))} generated regions match the data")
        return 0
    args.doc.write_text(new)
    print(f"{args.doc}: {len(regions(new))} generated regions rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
