"""The cost model against the forwards a service really ran: an instance's forward log
(`common.engine.forward_log`, `splitserve up --forward-log DIR`) holds each forward's shape and
measured seconds; the model prices the same shapes. Grouped by class (decode steps by batch,
prompt-carrying forwards by tokens), it separates two causes of a simulation that is off:
the model mispricing forwards (real / model seconds far from 1 in a class), and the simulated
loop arranging the work differently (other class counts than the real run's).

    python -m simulator.forward_check LOG.jsonl [LOG.jsonl...] --profile profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.plan import ForwardShape
from simulator.costs import CostModel

DECODE_BATCHES = (1, 2, 4, 8, 16, 32)  # lower bounds of the decode classes
PROMPT_TOKENS = (1, 33, 129, 513)  # lower bounds of the prefill and mixed classes


def _bucket(value: int, bounds: tuple[int, ...]) -> str:
    i = max(j for j, b in enumerate(bounds) if value >= b or j == 0)
    upper = bounds[i + 1] - 1 if i + 1 < len(bounds) else None
    low = bounds[i]
    return f"{low}" if upper == low else f"{low}-{upper}" if upper else f"{low}+"


def forward_class(shape: ForwardShape) -> str:
    """decode b1, decode b2-3, ... (sequences stepped); prefill/mixed t1-32, ... (tokens)."""
    if shape.kind == "decode":
        return f"decode b{_bucket(shape.decodes, DECODE_BATCHES)}"
    return f"{shape.kind} t{_bucket(shape.tokens, PROMPT_TOKENS)}"


def _order(name: str) -> tuple:
    kind, size = name.split(" ")
    return ("decode", "prefill", "mixed").index(kind), int(size[1:].split("-")[0].rstrip("+"))


def classes(real: list[dict], simulated: list[tuple[ForwardShape, float]],
            costs: CostModel) -> dict[str, dict]:
    """Per class: the real forwards (count, measured seconds, the model's seconds for the same
    shapes, their ratio, mean rows and context per forward) and the simulated ones (count,
    seconds)."""
    table: dict[str, dict] = {}

    def row(name: str) -> dict:
        return table.setdefault(name, {"real_forwards": 0, "real_s": 0.0, "model_on_real_s": 0.0,
                                       "real_rows": 0, "real_context": 0,
                                       "simulated_forwards": 0, "simulated_s": 0.0})
    for line in real:
        shape = line["shape"]
        r = row(forward_class(shape))
        r["real_forwards"] += 1
        r["real_s"] += line["forward_s"]
        r["model_on_real_s"] += costs.shape_s(shape)
        r["real_rows"] += shape.rows
        r["real_context"] += shape.context
    for shape, seconds in simulated:
        r = row(forward_class(shape))
        r["simulated_forwards"] += 1
        r["simulated_s"] += seconds
    for r in table.values():
        r["real_over_model"] = r["real_s"] / r["model_on_real_s"] if r["model_on_real_s"] else None
    return {name: table[name] for name in sorted(table, key=_order)}


def forward_classes(lines: list[dict] | None, simulated: list[tuple[ForwardShape, float]],
                    costs: CostModel) -> dict | None:
    """`classes` for a validation case: its real run's forward-log lines within the load's
    window (simulator.calibrate.case_lines), beside the simulated forwards; None for a run
    without a log."""
    if lines is None:
        return None
    table = classes(lines, simulated, costs)
    return {"classes": table, "all": totals(table), "largest_prefill_forward": {
        "real": largest_prefill([line["shape"] for line in lines]),
        "simulated": largest_prefill([shape for shape, _ in simulated])}}


def largest_prefill(shapes: list[ForwardShape]) -> int:
    """The most tokens a prompt-only forward computed: on a prefill instance its ChunkSize once
    a prompt exceeds it, so two sides that differ here ran different ChunkSizes (2026-11-28's
    Zen 4: 192 real against 64 simulated)."""
    return max((shape.tokens for shape in shapes if shape.kind == "prefill"), default=0)


LOOP_COUNTERS = {"busy_s": "busy_seconds", "num_forwards": "num_forwards",
                 "turn_s": "forward_turn_seconds"}


def loop_counters(view: dict) -> dict:
    """Summed over the instances of a `GET /cluster` answer: seconds in forwards, forwards, and
    the wall time of the loop turns that ran them."""
    return {key: sum(float(i.get(field, 0.0)) for i in view["instances"])
            for key, field in LOOP_COUNTERS.items()}


def measured_overhead(real: dict) -> float | None:
    """The instance loop's own seconds per forward in a real run (its turns less its forwards),
    None for a run recorded without them."""
    if not real.get("num_forwards"):
        return None
    return max(real["turn_s"] - real["busy_s"], 0.0) / real["num_forwards"]


def forward_time(real: dict, simulated: dict) -> dict:
    """A diagnostic beside the metrics (no target): the seconds the instances spent in forwards
    during the load, real and simulated, the forwards run and the loop's own seconds per forward.
    Close totals with far-off latencies point away from the cost model's total, toward where the
    time falls; None for a real run recorded without it."""
    r = real.get("busy_s")
    sim = simulated["summary"]["simulation"]
    s = sim["instances"]["busy_instance_s"]
    return {"real": r, "simulated": s, "relative_error": (s - r) / r if r else None,
            "real_forwards": real.get("num_forwards"), "simulated_forwards": sim["forwards"],
            "real_overhead_per_forward_s": measured_overhead(real)}


def totals(table: dict[str, dict]) -> dict:
    keys = ("real_forwards", "real_s", "model_on_real_s", "simulated_forwards", "simulated_s")
    total = {k: sum(r[k] for r in table.values()) for k in keys}
    total["real_over_model"] = (total["real_s"] / total["model_on_real_s"]
                                if total["model_on_real_s"] else None)
    return total


def format_classes(table: dict[str, dict]) -> str:
    lines = [f"{'class':<16}{'real n':>8}{'real ms':>9}{'model ms':>9}{'real/model':>11}"
             f"{'sim n':>8}{'sim ms':>8}"]
    for name, r in {**table, "all": totals(table)}.items():
        n, m = r["real_forwards"], r["simulated_forwards"]
        ratio = r["real_over_model"]
        lines.append(f"{name:<16}{n:>8}{(r['real_s'] / n * 1e3 if n else 0):>9.1f}"
                     f"{(r['model_on_real_s'] / n * 1e3 if n else 0):>9.1f}"
                     f"{(f'{ratio:.3f}' if ratio else '-'):>11}{m:>8}"
                     f"{(r['simulated_s'] / m * 1e3 if m else 0):>8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.forward_check",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path,
                        help="forward logs (JSON lines, priced with --profile), or validation "
                             "case files (their stored table is printed)")
    parser.add_argument("--profile", default=None, help="the profile record to fit")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    cases = [p for p in args.paths if p.suffix == ".json"]
    for path in cases:
        stored = json.loads(path.read_text()).get("forward_classes")
        print(f"{path.name}:\n" + (format_classes(stored["classes"]) if stored
                                    else "  recorded without a forward log"))
        largest = (stored or {}).get("largest_prefill_forward")
        if largest:
            print(f"largest prompt-only forward: {largest['real']} tokens real, "
                  f"{largest['simulated']} simulated")
    logs = [p for p in args.paths if p.suffix != ".json"]
    if logs:
        from common.engine.forward_log import read
        from simulator.validate import load_profiles, profile_for

        if not args.profile:
            raise SystemExit("error: forward logs are priced with --profile FILE")
        costs, _ = profile_for(load_profiles([args.profile]), args.threads)
        print(format_classes(classes([line for p in logs for line in read(p)], [], costs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
