"""The stack-ceiling benchmark's numbers: from raw runs to the table (pure; bench.stack_ceiling
measures).

Owns: the ratio of served output tok/s to the engine alone's, CPU per output token of each
process, the mean and spread over seeds of each (layout, mode) cell, and the Markdown table.
"""

from __future__ import annotations

import statistics

from bench.cpu_share import MACHINE, OTHERS


def ratio(served_tokens_per_s: float | None, alone_tokens_per_s: float | None) -> float | None:
    """Served output tok/s over the engine alone's (1.0: the stack costs nothing beyond
    the model's decode steps)."""
    if not served_tokens_per_s or not alone_tokens_per_s:
        return None
    return served_tokens_per_s / alone_tokens_per_s


def us_per_token(cpu_share: dict[str, float | None], wall_s: float,
                 output_tokens: int) -> dict[str, float | None]:
    """Each process's CPU microseconds per output token of the run (machine and others too)."""
    if output_tokens <= 0:
        return dict.fromkeys(cpu_share)
    return {name: None if share is None else share * wall_s / output_tokens * 1e6
            for name, share in cpu_share.items()}


def spread(values: list[float]) -> dict:
    """mean, standard deviation, min and max (None for no values)."""
    return {"mean": statistics.mean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values) if values else None, "max": max(values) if values else None}


def _mean_by_name(dicts: list[dict[str, float | None]]) -> dict[str, float | None]:
    names = dict.fromkeys(n for d in dicts for n in d)
    means = {}
    for name in names:
        values = [d[name] for d in dicts if d.get(name) is not None]
        means[name] = statistics.mean(values) if values else None
    return means


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (layout, mode), in run order: served tok/s, the engine alone measured just
    before each run, and their ratio, over the seeds (mean, spread); mean CPU share and CPU per
    output token of each process; errors."""
    rows = []
    for key in dict.fromkeys((r["layout"], r["mode"]) for r in runs):
        cell = [r for r in runs if (r["layout"], r["mode"]) == key]
        alone = [r["engine_alone"]["greedy_tokens_per_s"] for r in cell]
        ratios = [ratio(r["served_tokens_per_s"], a) for r, a in zip(cell, alone)]
        rows.append({"layout": key[0], "mode": key[1],
                     "served_tokens_per_s": spread([r["served_tokens_per_s"] or 0.0
                                                    for r in cell]),
                     "alone_tokens_per_s": spread(alone),
                     "alone_sampled_tokens_per_s": spread(
                         [r["engine_alone"]["sampled_tokens_per_s"] for r in cell]),
                     "ratio": spread([x if x is not None else 0.0 for x in ratios]),
                     "cpu_share": _mean_by_name([r["cpu_share"] for r in cell]),
                     "cpu_us_per_token": _mean_by_name([r["cpu_us_per_token"] for r in cell]),
                     "errors": sum(r["num_errors"] for r in cell)})
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: served tok/s and ratio (mean ± std over seeds), then each process's CPU in
    cores (share of the run's wall time) and in µs per output token."""
    lines = ["| layout | mode | served tok/s | engine alone tok/s | ratio | CPU, cores "
             "(µs per output token) |", "|---|---|---|---|---|---|"]
    for row in rows:
        cpu = ", ".join(_cpu_cell(name, share, row["cpu_us_per_token"].get(name))
                        for name, share in row["cpu_share"].items()
                        if share is not None and name != MACHINE)
        lines.append(f"| {row['layout']} | {row['mode']} | {_pm(row['served_tokens_per_s'])} | "
                     f"{_pm(row['alone_tokens_per_s'])} | {_pm(row['ratio'], 2)} | {cpu} |")
    return "\n".join(lines)


def _cpu_cell(name: str, share: float, us: float | None) -> str:
    if name == OTHERS or us is None:
        return f"{name} {share:.2f}"
    return f"{name} {share:.2f} ({us:.0f})"


def _pm(values: dict, digits: int = 0) -> str:
    if values["mean"] is None:
        return "-"
    return f"{values['mean']:.{digits}f} ± {values['std']:.{digits}f}"
