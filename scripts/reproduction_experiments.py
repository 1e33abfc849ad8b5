"""Per-experiment tables of docs/reproduction.md that are not plain compare runs: E6, E9, E12,
E13, E14 and E14 with the whole TetriInfer (for scripts/reproduction_tables.py).

This module owns how those tables read their JSON and the paper's numbers printed beside ours
(from ../shared/reference/seed-papers.md; they are the papers', not data of ours).
"""

from __future__ import annotations

import statistics

from reproduction_sources import (E13_SEEDS, NO_DATA, compare, data_line, inter_runs, load, num,
                                  overlap, pct, pct1, pm, seeds_text, spread, spread_over, table)

# -- E6 interference -------------------------------------------------------------------------------
E6_ROWS = [  # (label, JSON section, cell, the paper's number)
    ("LP alone", "prefill_prefill", "LP alone", ""),
    ("LP + 7 LP", "prefill_prefill", "LP + 7 LP", "2x"),
    ("LP + 63 LP", "prefill_prefill", "LP + 63 LP", "8x"),
    ("LP + HP (128)", "prefill_prefill", "LP + HP(128)", ">10x with HPs"),
    ("LP + HP (512)", "prefill_prefill", "LP + HP(512)", ">10x"),
    ("16 LD alone (per step)", "decode_prefill", "16 LD alone", ""),
    ("16 LD + HP (128)", "decode_prefill", "16 LD + HP(128)", ""),
    ("16 LD + HP (512)", "decode_prefill", "16 LD + HP(512)", "5x with one HP"),
    ("32 LD (per step)", "decode_decode", "32 LD", ""),
    ("16 LD + 16 HD", "decode_decode", "16 LD + 16 HD", "+23% latency, -16% throughput"),
]


def _e6_cells(now: dict | None, first: dict | None, section: str, cell: str) -> list[str]:
    if now is None:
        latency, slowdown = NO_DATA, ""
    else:
        point = now[section][cell]
        latency = f"{point['seconds'] * 1e3:.1f} ms"
        if "tokens_per_s" in point:
            latency += f", {point['tokens_per_s']:,.0f} tok/s"
        slowdown = f"{point['slowdown']:.1f}x"
    earlier = f"{first[section][cell]['slowdown']:.1f}x" if first is not None else NO_DATA
    return [latency, slowdown, earlier]


def e6() -> list[str]:
    now, first = load("interference/interference.json"), \
        load("interference_first_run/interference.json")
    body = [[label, *_e6_cells(now, first, section, cell), paper]
            for label, section, cell, paper in E6_ROWS]
    names = ["interference", "interference_first_run"]
    header = ["mix", "latency of the victim (now)", "slowdown (now)", "slowdown (first run)",
              "paper"]
    return [*table(header, body), "", data_line(
        names, "2 (one each)", "- (no sampling: fixed synthetic batches)",
        "not measured (each cell the median of 5 forwards)")]


# -- E9 prefill policies ---------------------------------------------------------------------------
E9_ROWS = [  # (system, label, baseline system, what the change is against, paper)
    ("vllm-1t", "vLLM-like fixed batch (vllm-1t)", None, "", ""),
    ("fcfs", "chunked FCFS", "vllm-1t", "vs fixed batch", "-86.4%"),
    ("sjf", "chunked SJF, PrefillSchedBatch 16", "fcfs", "vs FCFS", "-7.8% waiting time"),
    ("ljf", "chunked LJF", "fcfs", "vs FCFS", ""),
    ("sjf-128", "chunked SJF, PrefillSchedBatch 128", "sjf", "vs batch 16", "-46.5%"),
]


def e9(name: str = "compare_prefill_policies") -> list[str]:
    run = compare(name)
    body = []
    for system, label, base, against, paper in E9_ROWS:
        if run is None or not run.has(system):
            body.append([label, NO_DATA, "", "", paper])
            continue
        per_seed = ", ".join(f"{r['ttft_s']['mean'] * 1e3:.0f}" for r in run.runs(system))
        change = f"{pct(run.mean(system, 'TTFT mean'), run.mean(base, 'TTFT mean'))} {against}" \
            if base else ""
        body.append([label, pm(run.mean(system, "TTFT mean"), run.std(system, "TTFT mean")),
                     per_seed, change, paper])
    pairs = [(run.mean(s, "TTFT mean"), run.std(s, "TTFT mean")) for s, *_ in E9_ROWS
             if run is not None and run.has(s)]
    return [*table(["system", "TTFT mean (ms)", "per seed", "change", "paper"], body), "",
            data_line([name], "1" if run else NO_DATA, seeds_text([run] if run else []),
                      f"{spread(pairs)} (TTFT mean)")]


def e9_after() -> list[str]:
    return e9("compare_prefill_policies_after_kernels")


# -- E12 intra-decode admission, E13 inter-decode placement ----------------------------------------
def e12() -> list[str]:
    data = load("decode_intra/intra.json")
    if data is None:
        return table(["lengths", "admission", "mean JCT (s)", "vs greedy", "preemptions"],
                     [[NO_DATA, "", "", "", ""]])
    greedy = {r["lengths"]: r["mean_jct_s"] for r in data["rows"] if r["admission"] == "greedy"}
    body = [[r["lengths"], r["admission"], f"{r['mean_jct_s']:.1f}",
             "" if r["admission"] == "greedy" else pct1(r["mean_jct_s"], greedy[r["lengths"]]),
             r["preemptions"]] for r in data["rows"]]
    errors = sum(sum(r["errors"].values()) for r in data["rows"])
    gap = pct1(greedy["predicted"], greedy["true"])
    return [*table(["lengths", "admission", "mean JCT (s)", "vs greedy", "preemptions"], body), "",
            data_line(["decode_intra"], f"1 per policy ({errors} failed requests)",
                      str(data["options"]["seed"]), "not measured; the two greedy runs, "
                      f"which ignore predictions, differ by {gap}")]


E13_LABELS = {"power_of_two": "power_of_two (ours)",
              "power_of_two_ratio": "power_of_two_ratio (the paper's literal rule)",
              "random": "random", "round_robin": "round_robin",
              "imbalance": "imbalance (every heavy to one instance)"}


def _split(row: dict) -> str:
    """Finished requests per decode instance, in instance order: '32/31'."""
    per = row["per_instance"]
    return "/".join(str(per[i]["finished_heavy"] + per[i]["finished_light"]) for i in sorted(per))


def e13() -> list[str]:
    runs = inter_runs()
    header = ["dispatcher", "total decoding time (s), mean ± sd", "vs random", "per seed (s)",
              "finished per instance, seeds 0 / 1 / 2"]
    if runs is None:
        return table(header, [[NO_DATA, "", "", "", ""]])
    times = {p: [r["total_decoding_time_s"] for r in rows] for p, rows in runs.items()}
    base = times["random"]
    body = []
    for policy, rows in sorted(runs.items(), key=lambda kv: statistics.mean(times[kv[0]])):
        value = times[policy]
        versus = "" if policy == "random" else (
            f"{pct(statistics.mean(value), statistics.mean(base))}"
            + (" (not distinguishable)" if overlap(value, base) else ""))
        body.append([E13_LABELS.get(policy, policy),
                     pm(statistics.mean(value), statistics.stdev(value), 1), versus,
                     ", ".join(f"{v:.1f}" for v in value), ", ".join(_split(r) for r in rows)])
    ok = ", ".join(str(sum(r["num_ok"] for r in rows)) for rows in runs.values())
    return [*table(header, body), "", data_line(
        ["decode_inter_current"], f"3 per dispatcher, 64 requests each (completed over the "
        f"seeds: {ok})", ", ".join(map(str, E13_SEEDS)),
        "the per-seed times; a difference is called only where the seeds' ranges do not overlap")]


# -- E14 the five workloads ------------------------------------------------------------------------
WORKLOADS = ("LPLD", "LPHD", "HPLD", "HPHD", "Mixed")
FIRST_RUN = {w: f"compare_{w}_first_run" if w in ("LPLD", "LPHD", "Mixed") else f"compare_{w}"
             for w in WORKLOADS}
E14_SYSTEMS = ("disagg", "vllm", "vllm-1t")
E14_PAPER = {"LPLD": "-44% / -40% / 1.4x", "LPHD": "-97% / -47% / 2.4x",
             "HPLD": "-9% / -23% / vLLM 14% better", "HPHD": "more than HPLD / -19% / 1.1x",
             "Mixed": "-85% / -50% / 1.9x"}


def _e14_row(w: str, run, s: str) -> list:
    if run is None or not run.has(s):
        return [w, s, NO_DATA, "", "", "", "", ""]
    per_core = run.mean(s, "perf/$") / run.threads(s)
    return [w, s, pm(run.mean(s, "TTFT mean"), run.std(s, "TTFT mean")),
            pm(run.mean(s, "JCT mean") / 1e3, run.std(s, "JCT mean") / 1e3, 2),
            num(run.mean(s, "output tok/s")), pm(run.mean(s, "perf/$"), run.std(s, "perf/$")),
            num(per_core), run.data["results"][s]["errors"]]


def e14() -> list[str]:
    runs = {w: compare(FIRST_RUN[w]) for w in WORKLOADS}
    body = [_e14_row(w, runs[w], s) for w in WORKLOADS for s in E14_SYSTEMS]
    header = ["workload", "system", "TTFT mean (ms)", "JCT mean (s)", "output tok/s",
              "perf/$ (tok per instance busy-s)", "per core busy-s", "errors"]
    present = [r for r in runs.values() if r is not None]
    spread_text = spread_over(present, E14_SYSTEMS, "JCT mean")
    return [*table(header, body), "", data_line(list(FIRST_RUN.values()), str(len(present)),
                                                seeds_text(present), f"{spread_text} (JCT mean)")]


def _vs(run, base: str) -> str:
    """disagg against `base`: TTFT change / JCT change / perf/$ per core ratio."""
    if run is None or not (run.has("disagg") and run.has(base)):
        return NO_DATA
    per_core = {s: run.mean(s, "perf/$") / run.threads(s) for s in ("disagg", base)}
    return (f"{pct(run.mean('disagg', 'TTFT mean'), run.mean(base, 'TTFT mean'))} / "
            f"{pct(run.mean('disagg', 'JCT mean'), run.mean(base, 'JCT mean'))} / "
            f"{per_core['disagg'] / per_core[base]:.2f}x")


def e14_vs() -> list[str]:
    body = [[w, _vs(compare(FIRST_RUN[w]), "vllm"), _vs(compare(FIRST_RUN[w]), "vllm-1t"),
             E14_PAPER[w]] for w in WORKLOADS]
    header = ["workload", "disagg vs vllm (same 2 cores): TTFT / JCT / perf/$ per core",
              "disagg vs vllm-1t (paper's ratio): TTFT / JCT / perf/$ per core",
              "paper (TTFT / JCT / perf/$)"]
    return table(header, body)


def e14_rerun() -> list[str]:
    names = [f"compare_{w}" for w in ("LPLD", "LPHD", "Mixed")]
    runs = {n: compare(n) for n in names}
    body = []
    for name, run in runs.items():
        w = name.removeprefix("compare_")
        for s in E14_SYSTEMS:
            if run is None or not run.has(s):
                body.append([w, s, NO_DATA, "", "", "", ""])
                continue
            body.append([w, s, pm(run.mean(s, "TTFT mean"), run.std(s, "TTFT mean"), 1),
                         pm(run.mean(s, "TTFT p99"), run.std(s, "TTFT p99")),
                         pm(run.mean(s, "JCT mean"), run.std(s, "JCT mean")),
                         num(run.mean(s, "output tok/s"), 1), run.data["results"][s]["errors"]])
    present = [r for r in runs.values() if r is not None]
    header = ["workload", "system", "TTFT mean (ms)", "TTFT p99", "JCT mean (ms)",
              "output tok/s", "errors"]
    spread_text = spread_over(present, E14_SYSTEMS, "JCT mean")
    return [*table(header, body), "", data_line(names, str(len(present)), seeds_text(present),
                                                f"{spread_text} (JCT mean)")]


# -- E14 with the whole TetriInfer (issue 21) --------------------------------------------------------
WHOLE = {w: f"compare_tetriinfer_{w}" for w in ("LPHD", "Mixed")}
WHOLE_SYSTEMS = ("tetriinfer", "disagg", "vllm", "vllm-1t")


def _per_seed(run, system: str, key: str) -> list[float]:
    return [r[key]["mean"] for r in run.runs(system)]


def _whole_row(w: str, run, s: str) -> list:
    if run is None or not run.has(s):
        return [w, s, NO_DATA, "", "", "", "", "", "", ""]
    flips = [len(r.get("flips") or []) for r in run.runs(s)]
    return [w, s, pm(run.mean(s, "TTFT mean"), run.std(s, "TTFT mean")),
            num(run.mean(s, "TTFT p99")),
            pm(run.mean(s, "JCT mean") / 1e3, run.std(s, "JCT mean") / 1e3, 2),
            num(run.mean(s, "output tok/s"), 1), num(run.mean(s, "perf/$"), 1),
            num(run.mean(s, "perf/$ busy"), 1), ", ".join(map(str, flips)),
            run.data["results"][s]["errors"]]


def _whole_vs(run, base: str) -> str:
    """tetriinfer against `base`: TTFT and JCT changes, "(n.d.)" where the seeds overlap."""
    if run is None or not (run.has("tetriinfer") and run.has(base)):
        return NO_DATA
    cells = []
    for label, key, metric in (("TTFT", "ttft_s", "TTFT mean"), ("JCT", "jct_s", "JCT mean")):
        a, b = _per_seed(run, "tetriinfer", key), _per_seed(run, base, key)
        cells.append(f"{label} {pct(run.mean('tetriinfer', metric), run.mean(base, metric))}"
                     + (" (n.d.)" if overlap(a, b) else ""))
    return ", ".join(cells)


def e14_whole() -> list[str]:
    runs = {w: compare(name) for w, name in WHOLE.items()}
    body = [_whole_row(w, runs[w], s) for w in WHOLE for s in WHOLE_SYSTEMS]
    header = ["workload", "system", "TTFT mean (ms)", "TTFT p99", "JCT mean (s)",
              "output tok/s", "perf/$ (tok per instance wall-s)", "perf/$ busy",
              "flips per seed", "errors"]
    present = [r for r in runs.values() if r is not None]
    vs = [[w, _whole_vs(runs[w], "vllm"), _whole_vs(runs[w], "vllm-1t"),
           _whole_vs(runs[w], "disagg")] for w in WHOLE]
    spread_text = spread_over(present, WHOLE_SYSTEMS, "JCT mean")
    return [*table(header, body), "", *table(
        ["workload", "tetriinfer vs vllm (same 2 cores)", "vs vllm-1t (paper's ratio)",
         "vs disagg 1P+1D without its parts"], vs), "",
        data_line(list(WHOLE.values()), str(len(present)), seeds_text(present),
                  f"{spread_text} (JCT mean)")]


# -- E2 decode-maximal cost ------------------------------------------------------------------------
def e2() -> list[str]:
    data = load("e2_piggyback/piggyback.json")
    header = ["forward shape", "per prefill token (ms)", "per decode token alone (ms)",
              "per decode token piggybacked (ms)", "decode speed-up, mean (range)"]
    if data is None:
        return table(header, [[NO_DATA, "", "", "", ""]])
    body = []
    for name, s in data["summary"].items():
        shape, speed = data["shapes"][name], s["speedup"]
        label = (f"{shape['chunk']}-token chunk + {shape['decodes']} decodes of "
                 f"{shape['context']} (decode-only batch {shape['decode_only_batch']})")
        body.append([label,
                     f"{s['per_prefill_token_ms']['mean']:.2f}",
                     f"{s['per_decode_token_alone_ms']['mean']:.2f}",
                     f"{s['per_decode_token_piggybacked_ms']['mean']:.2f}",
                     f"{speed['mean']:.1f}x ({speed['min']:.1f}-{speed['max']:.1f})"
                     if speed else "-"])
    runs = data["options"]["runs"]
    return [*table(header, body), "", data_line(
        ["e2_piggyback"], f"{runs} per shape, each forward the median of "
        f"{data['options']['repeats']}", "- (no sampling)",
        f"the range of the speed-up over the {runs} runs; {data['dtype']}, "
        f"{data['threads']} threads")]


BUILDERS = {"E2": e2, "E6": e6, "E9": e9, "E9-after": e9_after, "E12": e12, "E13": e13,
            "E14": e14, "E14-vs": e14_vs, "E14-rerun": e14_rerun, "E14-whole": e14_whole}
