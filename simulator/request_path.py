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
MISPAIRED_S = 1.0  # a longer "hand-off" on one host is a mispairing or an admission wait


def handoff(logs: dict[str, list[dict]], window: tuple[float, float]) -> dict | None:
    """The KV hand-off as a fixed time plus a time per prompt token (a line through the load's
    hand-offs with a robust slope and their mean, `_line_fit`: the read's bytes grow with the
    prompt). A hand-off runs from the prefill forward that sampled a prompt's first token (one
    chunk, so its prompt is its cached plus new tokens) to when the decode instance had the
    sequence's KV: read off the step that took the sequence on (one sequence whose context is
    the prompt, or a batch one sequence larger than the step before, its context grown by the
    prompt beyond the others' new tokens): the step's start if the instance had run nothing
    since the prefill, else halfway between the step before and this one. `logs`: each
    instance's forward log by instance id, `window`: the load's. Returns {"handoff_s",
    "handoff_per_token_s", "handoffs"}; None with fewer than MIN_HANDOFFS pairs (a co-located
    layout)."""
    pairs = _handoff_pairs(logs, window)
    if len(pairs) < MIN_HANDOFFS:
        return None
    fixed, per_token = _line_fit(pairs)
    return {"handoff_s": fixed, "handoff_per_token_s": per_token, "handoffs": len(pairs)}


def _handoff_pairs(logs: dict[str, list[dict]], window: tuple[float, float]) \
        -> list[tuple[int, float]]:
    """(prompt tokens, seconds) of each hand-off that began in the window (see `handoff`)."""
    start, end = window
    sampled: dict[int, list[float]] = {}  # prompt tokens -> when a prefill forward sampled one
    for name, lines in logs.items():
        for line in lines if name.startswith("prefill") else ():
            shape = line["shape"]
            if shape.rows == 1 and shape.prompts == 1 and not shape.decodes:
                sampled.setdefault(shape.context + shape.tokens, []).append(line["time"])
    for times in sampled.values():
        times.sort()
    pairs, used = [], set()
    for name, lines in logs.items():
        for previous, line in zip([None, *lines], lines) if name.startswith("decode") else ():
            prompt = _joined(previous, line)
            times = sampled.get(prompt, [])  # the latest prefill of that prompt before the step
            i = bisect_left(times, line["time"] - line["turn_s"]) - 1
            if i < 0 or (prompt, i) in used or not start <= times[i] <= end:
                continue
            arrived = _arrival(previous, line, times[i])
            if arrived is not None:
                used.add((prompt, i))
                pairs.append((prompt, arrived - times[i]))
    return pairs


def _joined(previous: dict | None, line: dict) -> int | None:
    """The prompt tokens of the one sequence a decode step took on beside those of the step
    before (each of which gained a token), or of a step of one sequence; None otherwise."""
    shape = line["shape"]
    if shape.kind != "decode":
        return None
    if shape.decodes == 1:
        return shape.context
    before = previous["shape"] if previous else None
    if before is None or before.kind != "decode" or shape.decodes != before.decodes + 1:
        return None
    return shape.context - before.context - before.decodes


def _arrival(previous: dict | None, line: dict, sampled: float) -> float | None:
    """When the sequence's KV was in: a step of it alone on an instance idle since the prefill
    started right then (the loop polls every millisecond while a read runs); a step that took
    it on beside others, halfway between the turn before (or the prefill) and this one's start.
    None for a lone step on an instance busy in between (another sequence's later step)."""
    began = line["time"] - line["turn_s"]
    if line["gap_s"] >= began - sampled:
        return began if line["shape"].decodes == 1 else None
    if line["shape"].decodes == 1 or previous is None:
        return None
    return (max(previous["time"] - previous["turn_s"], sampled) + began) / 2


def _line_fit(pairs: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of seconds = a + b x tokens, both >= 0: b robust (Theil-Sen, the median of the
    pairwise slopes), a the mean of seconds - b x tokens. The mean, not the median: the
    simulator adds the line to every hand-off, and mean TPOT is a target whose requests of a few
    tokens are mostly their hand-off, which has a tail (a read waiting behind the prefill
    instance's forwards: on 2026-11-29's 1P2D HPLD high runs the cases' hand-offs lay 11-19 ms
    above the held-out line in mean, -0.5 to 11 ms in median). Pairs over MISPAIRED_S are left
    out (a chance match of two contexts, a wait for admission the simulator runs itself: one 9 s
    pair among 27 of 20-93 ms on a high-rate run). A falling fit is a flat one (the mean); a
    negative intercept one through the origin (the mean seconds per token)."""
    kept = [(x, y) for x, y in pairs if y <= MISPAIRED_S] or pairs
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(kept)
              for x2, y2 in kept[i + 1:] if x2 != x1]
    b = statistics.median(slopes) if slopes else 0.0
    if b <= 0:
        return statistics.fmean(y for _, y in kept), 0.0
    a = statistics.fmean(y - b * x for x, y in kept)
    if a < 0:
        return 0.0, sum(y for _, y in kept) / max(sum(x for x, _ in kept), 1)
    return a, b
