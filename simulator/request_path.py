"""The serving stack's own latency per request, outside the instance's forwards: the client's
HTTP request, the gateway's parsing, tokenization and routing, the message hop to the instance,
and the first token's way back (detokenization, the SSE chunk, the client's parse). The
simulator's instances see a request the moment the gateway routes it, so without this term its
TTFTs (and JCTs) are short by that much on every request.

Measured before a validation load on the idle cluster: a few single requests, one at a time
(a short prompt, one output token), each one prefill forward; the latency is the median TTFT
less the median of those forwards' seconds in the instances' forward log. The simulator charges
it on each request's way to its instance (`Layout.request_latency_s`).

The KV hand-off between a prefill and a decode instance has its own such latency beyond the
link: the offer, the admission, the read served by the prefill instance's thread beside its
forwards, the received sequence joining the decode loop. `handoff` reads it off the forward logs
of a load (`Layout.handoff_s`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from bisect import bisect_left
from dataclasses import replace


PROBES = 3
SPACING_S = 0.5  # each probe alone: its prefill takes tens of milliseconds


def probe(url: str, model: str, request, prompt: str) -> dict:
    """Send PROBES copies of `request` (prompt replaced, one output token) one at a time; their
    TTFTs and the wall-clock window to cut the forward log to."""
    from bench.client import run_load

    probes = [replace(request, prompt=prompt, max_tokens=1)] * PROBES
    start = time.time()
    records = asyncio.run(run_load(url, model, probes, [i * SPACING_S for i in range(PROBES)],
                                   ignore_eos=True, progress=False))
    return {"ttft_s": [r.ttft for r in records], "window": [start, time.time()]}


def latency(path_probe: dict | None, lines: list[dict]) -> float | None:
    """The median probe TTFT less the median seconds of the prompt forwards in its window
    (`lines`: the forward log, every instance's); None without a probe or its forwards."""
    if not path_probe or None in path_probe["ttft_s"]:
        return None
    start, end = path_probe["window"]
    forwards = [line["forward_s"] for line in lines
                if start <= line["time"] <= end and line["shape"].kind != "decode"]
    if not forwards:
        return None
    return max(statistics.median(path_probe["ttft_s"]) - statistics.median(forwards), 0.0)


MIN_HANDOFFS = 3  # fewer pairs: no hand-off is read off the log


def handoff(logs: dict[str, list[dict]], window: tuple[float, float]) -> dict | None:
    """The KV hand-off as a fixed time plus a time per prompt token (least squares over the
    load's hand-offs: the read's bytes grow with the prompt). A hand-off runs from the prefill
    forward that sampled a prompt's first token (one chunk, so its prompt is its cached plus
    new tokens) to the start of the decode forward that stepped that prompt's sequence alone
    on an instance that had run nothing since (its context is the prompt: the sequence just
    received). `logs`: each instance's forward log by instance id, `window`: the load's.
    Returns {"handoff_s", "handoff_per_token_s", "handoffs"}; None with fewer than
    MIN_HANDOFFS pairs (a co-located layout, a decode instance never idle)."""
    pairs = _handoff_pairs(logs, window)
    if len(pairs) < MIN_HANDOFFS:
        return None
    fixed, per_token = _line_fit(pairs)
    return {"handoff_s": fixed, "handoff_per_token_s": per_token, "handoffs": len(pairs)}


def _handoff_pairs(logs: dict[str, list[dict]], window: tuple[float, float]) \
        -> list[tuple[int, float]]:
    """(prompt tokens, seconds) of each hand-off in the window (see `handoff`): from each
    prefill forward of one chunk that sampled, to the first decode step after it that stepped
    one sequence of that context, if that decode instance ran no forward in between (its gap
    before the step covers the hand-off). A step of another sequence can reach the same context
    later, and a decode instance that was busy joins the sequence to a batch: neither passes."""
    start, end = window
    steps: dict[int, list[tuple[float, float]]] = {}  # context -> (began, gap) of lone steps
    for name, lines in logs.items():
        for line in lines if name.startswith("decode") else ():
            shape = line["shape"]
            if shape.kind == "decode" and shape.decodes == 1:
                steps.setdefault(shape.context, []).append(
                    (line["time"] - line["turn_s"], line["gap_s"]))
    for began in steps.values():
        began.sort()
    pairs = []
    for name, lines in logs.items():
        for line in lines if name.startswith("prefill") else ():
            shape, sampled = line["shape"], line["time"]
            if not (start <= sampled <= end and shape.rows == 1 and shape.prompts == 1
                    and not shape.decodes):
                continue
            prompt = shape.context + shape.tokens
            later = steps.get(prompt, [])
            i = bisect_left(later, (sampled,))
            if i < len(later) and later[i][1] >= later[i][0] - sampled:
                pairs.append((prompt, later[i][0] - sampled))
    return pairs


def _line_fit(pairs: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of seconds = a + b x tokens by least squares, both >= 0: a falling fit is a flat
    one (the mean), a negative intercept one through the origin."""
    xs, ys = [float(x) for x, _ in pairs], [y for _, y in pairs]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if b <= 0:
        return my, 0.0
    if my - b * mx < 0:
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return my - b * mx, b
