"""The crossover study's figure and table, from the JSON simulator/study.py wrote.

- `plot`: docs/simulator_crossover.png: per workload, goodput per instance against the offered
  load per instance for every layout (mean over the seeds, bars from the lowest to the highest
  seed), and goodput per instance against the instance count (scale.json).
- `crossover_table`: per workload, load and SLO, the best disaggregated layout against the
  best co-located one; a side "wins" only where it is ahead on every seed (both ran the same
  requests per seed), else the difference is inside the seeds' spread: "not distinguishable"
  ("equal": the same goodput on every seed, typically every request met the SLOs).
  Written as summary.json beside the raw files and printed as Markdown for docs/simulator.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from simulator.plan import paired_verdict
from simulator.pools import WORKLOADS

MARKERS = {"vllm": "s", "sarathi": "D"}


def load_rows(out: Path, workload: str) -> dict | None:
    path = out / f"crossover_{workload}.json"
    return json.loads(path.read_text()) if path.exists() else None


def series(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows per candidate label, by increasing load."""
    found: dict[str, list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["offered_per_instance"]):
        found.setdefault(row["candidate"], []).append(row)
    return found


def draw_workload(ax, data: dict) -> None:
    for label, rows in series(data["rows"]).items():
        xs = [r["offered_per_instance"] for r in rows]
        good = [r["goodput_per_instance"] for r in rows]
        means = [g["mean"] for g in good]
        spread = [[m - g["min"] for m, g in zip(means, good)],
                  [g["max"] - m for m, g in zip(means, good)]]
        policy = label.split()[0]
        ax.errorbar(xs, means, yerr=spread, marker=MARKERS.get(policy, "o"), capsize=3,
                    linestyle="--" if policy in MARKERS else "-", label=label)
    top = max(r["offered_per_instance"] for r in data["rows"])
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8, label="offered")
    prompt, output = data["mean_lengths"]
    ax.set_title(f"{data['workload']} (mean prompt {prompt:.0f}, output {output:.0f})",
                 fontsize=9)
    ax.set_xlabel("offered req/s per instance")
    ax.set_ylabel("goodput req/s per instance")


def draw_scale(ax, data: dict) -> None:
    for label, rows in series_by_kind(data["rows"]).items():
        rows.sort(key=lambda r: r["instances"])
        ax.plot([r["instances"] for r in rows],
                [r["goodput_per_instance"]["mean"] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_title(f"{data['workload']} at {data['rows'][0]['offered_per_instance']:.1f} req/s "
                 "per instance, 1 seed", fontsize=9)
    ax.set_xlabel("instances")
    ax.set_ylabel("goodput req/s per instance")


def series_by_kind(rows: list[dict]) -> dict[str, list[dict]]:
    """Scale rows grouped by prefill share or co-located policy, whatever the count."""
    found: dict[str, list[dict]] = {}
    for row in rows:
        layout = row["layout"]
        kind = (f"split {layout['num_prefill'] / row['instances']:.2f} prefill"
                if layout["num_prefill"] else layout["policy"])
        found.setdefault(kind, []).append(row)
    return found


def plot(out: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 9))
    for ax, workload in zip(axes.flat, WORKLOADS):
        data = load_rows(out, workload)
        if data is not None:
            draw_workload(ax, data)
    scale_path = out / "scale.json"
    if scale_path.exists():
        draw_scale(axes.flat[5], json.loads(scale_path.read_text()))
    for ax in axes.flat:
        if ax.has_data():
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Simulated goodput per instance (8 instances; last panel 8-256; H100 + "
                 "Llama-2-7B from PUBLISHED FIGURES, not measured)", fontsize=11)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    table = crossover_table(out)
    (out / "summary.json").write_text(json.dumps(table, indent=1) + "\n")
    print(markdown(table))
    print(f"wrote {png} and {out / 'summary.json'}")


def best(rows: list[dict], disaggregated: bool, slo: int) -> dict:
    kind = [r for r in rows if bool(r["layout"]["num_coupled"]) != disaggregated]
    return max(kind, key=lambda r: r["goodput_per_instance_by_slo"][slo]["mean"])


def verdict(split: dict, coupled: dict, slo: int) -> str:
    """Paired over the seeds (both ran the same requests): a side wins when it is ahead on
    every seed."""
    a, b = (r["goodput_per_instance_by_slo"][slo] for r in (split, coupled))
    if a["per_seed"] == b["per_seed"]:
        return "equal"
    return {1: "split wins", -1: "co-located wins", 0: "not distinguishable"}[
        paired_verdict(a, b)]


def compare(rows: list[dict], slo: int) -> dict:
    split, coupled = best(rows, True, slo), best(rows, False, slo)
    return {"slo": slo, "best_split": split["candidate"],
            "split_goodput": split["goodput_per_instance_by_slo"][slo],
            "best_colocated": coupled["candidate"],
            "colocated_goodput": coupled["goodput_per_instance_by_slo"][slo],
            "verdict": verdict(split, coupled, slo)}


def crossover_table(out: Path) -> list[dict]:
    """Per workload and load: `compare` under each SLO of the study."""
    table = []
    for workload in WORKLOADS:
        data = load_rows(out, workload)
        if data is None:
            continue
        by_load: dict[float, list[dict]] = {}
        for row in data["rows"]:
            by_load.setdefault(row["offered_per_instance"], []).append(row)
        for load, rows in sorted(by_load.items()):
            table.append({"workload": workload, "offered_per_instance": load,
                          "load_x_anchor": load / data["anchor_rate"],
                          "slos": data["slos"],
                          "by_slo": [compare(rows, i) for i in range(len(data["slos"]))]})
    return table


def markdown(table: list[dict]) -> str:
    """The first SLO's comparison in full, the others' verdicts in the last column."""
    lines = [("| workload | offered req/s per instance (x anchor) | best split: goodput per "
              "instance [per seed] | best co-located: goodput per instance [per seed] | verdict "
              "| other SLOs |"), "|---|---|---|---|---|---|"]
    cell = lambda name, g: f"{name}: {g['mean']:.2f} [" + \
        ", ".join(f"{x:.2f}" for x in g["per_seed"]) + "]"
    for row in table:
        first, others = row["by_slo"][0], row["by_slo"][1:]
        lines.append(f"| {row['workload']} | {row['offered_per_instance']:.1f} "
                     f"({row['load_x_anchor']:.2f}) | "
                     f"{cell(first['best_split'], first['split_goodput'])} | "
                     f"{cell(first['best_colocated'], first['colocated_goodput'])} | "
                     f"{first['verdict']} | " + "; ".join(
                         f"{slo_name(row['slos'][o['slo']])}: {o['verdict']}" for o in others)
                     + " |")
    return "\n".join(lines)


def slo_name(slo: dict) -> str:
    return f"p{slo['tbt_percentile']:g} TBT {slo['tbt_s'] * 1e3:g} ms"
