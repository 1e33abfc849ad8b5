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

from common.engine.forward_log import WAITED_S

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


def handoff(logs: dict[str, list[dict]], window: tuple[float, float]) -> float | None:
    """The mean time from a prefill forward that sampled a first token (a prompt's last chunk)
    to the start of the next decode forward, counted where that forward stepped one sequence
    after its instance had waited for work (so, the sequence just received); `logs`: each
    instance's forward log by instance id, `window`: the load's. None without such a pair (a
    co-located layout, or a decode instance never idle)."""
    start, end = window
    firsts = [line["time"] for name, lines in logs.items() if name.startswith("prefill")
              for line in lines if line["shape"].rows and start <= line["time"] <= end]
    begins = sorted(((line["time"] - line["turn_s"], line) for name, lines in logs.items()
                     if name.startswith("decode") for line in lines), key=lambda pair: pair[0])
    starts = [began for began, _ in begins]
    samples = []
    for first in firsts:
        i = bisect_left(starts, first)
        if i < len(begins):
            began, line = begins[i]
            if line["gap_s"] > WAITED_S and line["shape"].kind == "decode" \
                    and line["shape"].decodes == 1:
                samples.append(began - first)
    return statistics.mean(samples) if samples else None
