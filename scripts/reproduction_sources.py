"""The committed benchmark data behind docs/reproduction.md (for scripts/reproduction_tables.py).

This module owns where each result came from: which JSON under docs/benchmarks/ holds it, on
which host it ran (CPU kind), how many runs and seeds it has and how widely they spread, and
the number formats the tables use. Most of the JSON predates recording the CPU kind, so HOSTS
maps each data directory to the session that made it, from the run times in the docs and the
commits that added the data; a JSON that records its own CPU (`machine.cpu.kind`, bench/machine.py)
is taken at its word.

A missing file is not an error: it loads as None and the tables say "no committed data".
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "docs" / "benchmarks"
NO_DATA = "no committed data"

ZEN4 = "AMD EPYC Zen 4, AVX-512 BF16"
# The second session's VM: recorded as Zen 4, but its bfloat16 matmul rate (945 GFLOP/s on two
# cores) is about twice what the other Zen 4 hosts measured (374-448), so it is kept apart.
EPYC_945 = "AMD EPYC, AVX-512 BF16 (recorded as Zen 4, at twice its matmul rate)"
AVX2 = "AMD EPYC, AVX2 only (float32)"
XEON = "Intel Xeon, AVX-512 without BF16 or AMX"
ZEN5 = "AMD EPYC Zen 5, AVX-512 BF16"

# session -> (CPU kind, when): from docs/engine.md's host notes and the commit times.
SESSIONS = {
    1: (ZEN4, "first session, 2026-11-26 until 04:20 UTC, bf16 matmul 427 GFLOP/s"),
    2: (EPYC_945, "second session, 2026-11-26 05:50-07:30 UTC, bf16 matmul 945 GFLOP/s"),
    3: (AVX2, "third session, 2026-11-26 08:30-10:10 UTC"),
    4: (ZEN4, "fourth session, 2026-11-26 11:00-13:10 UTC, bf16 matmul 374-448 GFLOP/s"),
    5: (ZEN4, "fifth session, 2026-11-26 14:40-15:50 UTC, bf16 matmul 378-433 GFLOP/s"),
    6: (XEON, "sixth session, 2026-11-26, committed 19:14-19:38 UTC"),
    7: (ZEN5, "a session of 2026-11-27, committed 04:43 UTC"),
    8: (AVX2, "a session of 2026-11-27, 08:55-11:55 UTC (family 25, Zen 3)"),
    9: (AVX2, "a session of 2026-11-27, 12:27-15:27 UTC (family 25, Zen 3)"),
    10: (ZEN5, "a session of 2026-11-27, 15:32-18:32 UTC (family 26, Zen 5)"),
    11: (XEON, "a session of 2026-11-27, 18:45-21:45 UTC (family 6 model 85, AVX-512 VNNI)"),
    12: (AVX2, "a session of 2026-11-28, 05:25-08:25 UTC (family 25, Zen 3)"),
    13: (ZEN4, "a session of 2026-11-28, 08:31-11:31 UTC (family 25 model 17, Zen 4)"),
}
# data directory (under docs/benchmarks) -> session
HOSTS = {
    "compare_vllm_cpu_before_kernels": 1, "decode_intra": 1, "decode_inter": 1,
    "compare_sarathi_ablation": 1, "compare_sarathi_ablation_rerun": 1,
    "interference_first_run": 1, "compare_fastserve": 1, "compare_prefill_policies": 1,
    "compare_LPLD_first_run": 1, "compare_LPHD_first_run": 1, "compare_HPLD": 1,
    "compare_HPHD": 1, "compare_Mixed_first_run": 1, "transfer_emulation": 1,
    "compare_vllm_cpu": 2, "compare_vllm_cpu_budget": 2, "compare_LPLD": 2, "compare_LPHD": 2,
    "compare_Mixed": 2, "compare_sarathi_ablation_after_kernels": 2,
    "compare_sarathi_ablation_rate4": 2, "interference": 2, "compare_fastserve_rate5": 2,
    "compare_prefill_policies_after_kernels": 2,
    "compare_vllm_cpu_avx2": 3, "compare_vllm_cpu_avx2_skinny": 3, "compare_vllm_cpu_avx2_tail": 3,
    "compare_vllm_cpu_zen4_s4": 4, "compare_vllm_cpu_zen4_s4_rerun": 4,
    "compare_vllm_cpu_zen4_s4_budget": 4,
    **{f"compare_vllm_cpu_zen4_s5_run{n}": 5 for n in range(1, 5)},
    "compare_sarathi_ablation_hphd": 5,
    "length_predictor/sixth-session": 6,
    "decode_inter_current": 7, "compare_phase_shift": 8,
    "compare_tetriinfer_LPHD": 9, "compare_tetriinfer_Mixed": 9,
    "compare_sarathi_ablation_budget1024": 9,
    "length_predictor/e10": 10, "compare_tetriinfer_Mixed_zen5": 10,
    "compare_tetriinfer_Mixed_zen5_sampled": 10, "compare_tetriinfer_LPLD_zen5": 10,
    "compare_tetriinfer_LPLD_zen5_sampled": 10,
    "compare_sarathi_ablation_budget1024_zen5": 10,
    "compare_sarathi_ablation_budget1024_zen5_sampled": 10,
    "decode_intra_xeon": 11, "compare_phase_shift_xeon": 11,
    "compare_phase_shift_xeon_sampled": 11, "compare_routing_xeon_multiturn": 11,
    "compare_fastserve_zen3_rate5_b8": 12, "compare_fastserve_zen3_rate5_b8_sampled": 12,
    "compare_phase_shift_zen3_migrate": 12, "compare_phase_shift_zen3_migrate_sampled": 12,
    **{f"compare_fastserve_zen4_rate{rate}_b8{mode}": 13 for rate in (5, 10)
       for mode in ("", "_sampled")},
}


@cache
def load(relative: str):
    """The JSON at docs/benchmarks/<relative>, or None when it is not committed."""
    path = BENCH / relative
    return json.loads(path.read_text()) if path.is_file() else None



E13_SEEDS = (0, 1, 2)


def inter_runs(name: str = "decode_inter_current") -> dict[str, list[dict]] | None:
    """E13's rerun: dispatcher -> its row of each seed's inter.json (seed order), or None when
    a seed's file is not committed."""
    seeds = [load(f"{name}/seed{seed}/inter.json") for seed in E13_SEEDS]
    if None in seeds:
        return None
    runs: dict[str, list[dict]] = {}
    for data in seeds:
        for r in data["rows"]:
            runs.setdefault(r["policy"], []).append(r)
    return runs


def overlap(a: list[float], b: list[float]) -> bool:
    """Whether two sets of per-seed values share any range: then "not distinguishable"."""
    return min(a) <= max(b) and min(b) <= max(a)


def change(values: list[float], base: list[float], fmt=None) -> str:
    """The change of the per-seed `values`' mean against `base`'s ("+7%", with `fmt` pct1
    "+7.0%"), tagged " (n.d.)" where the two sets of seeds overlap."""
    text = (fmt or pct)(statistics.mean(values), statistics.mean(base))
    return text + (" (n.d.)" if overlap(values, base) else "")

def committed(name: str) -> bool:
    return (BENCH / name).is_dir()


def compare(name: str) -> Compare | None:
    data = load(f"{name}/compare.json")
    return Compare(name, data) if data is not None else None


@dataclass
class Compare:
    """One `splitserve bench compare` run: per-system means and sds over seeds, per-seed runs."""

    name: str
    data: dict

    @property
    def seeds(self) -> list[int]:
        return list(self.data["options"]["seeds"])

    def has(self, system: str) -> bool:
        return system in self.data["results"]

    def mean(self, system: str, metric: str) -> float:
        return self.data["results"][system][metric]["mean"]

    def std(self, system: str, metric: str) -> float:
        return self.data["results"][system][metric]["std"]

    def runs(self, system: str) -> list[dict]:
        return self.data["runs"][system]

    def threads(self, system: str) -> int:
        """Torch threads per instance: the disaggregated cluster and `--threads-per-instance 1`
        systems run one; a co-located instance gets both cores (the `equal` layout)."""
        custom = dict(c.split("=", 1) for c in self.data["options"].get("custom", []))
        one = system == "disagg" or "--threads-per-instance 1" in custom.get(system, "")
        return 1 if one else 2


# -- provenance: the CPU kind, runs, seeds and spread columns --------------------------------------
def cpu_kind(name: str) -> str:
    """The CPU kind of one data directory: its own record, else the session that made it."""
    for path in sorted((BENCH / name).glob("*.json")):
        candidate = load(f"{name}/{path.name}")
        if isinstance(candidate, dict):
            recorded = candidate.get("machine", {}).get("cpu", {})
            if isinstance(recorded, dict) and recorded.get("kind"):
                return recorded["kind"]
    session = HOSTS.get(name)
    return SESSIONS[session][0] if session else "unknown"


def kinds(names: list[str]) -> str:
    return "; ".join(dict.fromkeys(cpu_kind(n) for n in names))


def session_note(name: str) -> str:
    session = HOSTS.get(name)
    return SESSIONS[session][1] if session else "session not recorded"


def seeds_text(runs: list[Compare]) -> str:
    seeds = sorted({s for r in runs for s in r.seeds})
    return ", ".join(map(str, seeds)) if seeds else "-"


def spread(pairs: list[tuple[float, float]]) -> str:
    """'sd x-y% of the mean' over (mean, sd) pairs: the widest and narrowest spread over seeds."""
    ratios = [100 * sd / mean for mean, sd in pairs if mean]
    if not ratios:
        return NO_DATA
    low, high = min(ratios), max(ratios)
    return f"sd {low:.0f}-{high:.0f}% of the mean" if round(low) != round(high) \
        else f"sd {low:.0f}% of the mean"


def spread_over(runs, systems, metric: str) -> str:
    """`spread` of `metric` over every run x system (the runs' per-seed means and sds)."""
    return spread([(r.mean(s, metric), r.std(s, metric)) for r in runs for s in systems])


def binomial_se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n)


# -- number formats --------------------------------------------------------------------------------
def num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def pm(mean: float, sd: float, digits: int = 0) -> str:
    return f"{num(mean, digits)} ± {num(sd, digits)}"


def pct(new: float, base: float) -> str:
    """Relative change, signed: '-15%'."""
    return f"{100 * (new / base - 1):+.0f}%"


def pct1(new: float, base: float) -> str:
    return f"{100 * (new / base - 1):+.1f}%"


def row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(header: list[str], rows: list[list]) -> list[str]:
    return [row(header), row(["---"] * len(header)), *(row(r) for r in rows)]


def data_line(names: list[str], runs: str, seeds: str, spread_text: str) -> str:
    """The provenance line under a generated table."""
    paths = ", ".join(f"`docs/benchmarks/{n}/`" for n in names)
    hosts = "; ".join(dict.fromkeys(f"{cpu_kind(n)} ({session_note(n)})" for n in names))
    return f"Data: {paths}. CPU: {hosts}. Runs: {runs}; seeds: {seeds}; spread: {spread_text}."
