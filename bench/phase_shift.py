"""Phase-shift experiment: a decode-heavy burst, then a prefill-heavy one, against a cluster whose
transition watcher is on; records roles and queue lengths over time (JSON + PNG).

Run a cluster with a watcher first, e.g.
    splitserve up --prefill 2 --decode 1 --flip-policy load-ratio --flip-option cooldown_s=5
then `splitserve bench --experiment phase-shift --url ...` (or `python -m bench.phase_shift`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class PhaseShiftOptions:
    url: str = "http://127.0.0.1:8000"
    decode_requests: int = 48  # short prompts, long outputs
    decode_max_tokens: int = 160
    prefill_requests: int = 32  # long prompts, two output tokens
    prefill_prompt_words: int = 120
    prefill_max_tokens: int = 2
    concurrency: int = 64
    settle_s: float = 5.0  # observe this long after each burst
    out: str = "results/phase_shift"


async def _send(client, url, model, prompt, max_tokens, gate):
    async with gate:
        response = await client.post(url + "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
        return response.status_code


async def _burst(options, model, prompts, max_tokens):
    gate = asyncio.Semaphore(options.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*(_send(client, options.url, model, p, max_tokens, gate)
                                      for p in prompts))


async def _run(options: PhaseShiftOptions) -> dict:
    async with httpx.AsyncClient(timeout=10) as client:
        model = (await client.get(options.url + "/v1/models")).json()["data"][0]["id"]
    started = time.time()
    marks = {"start": started}
    short = [f"Write a long story about the number {i}." for i in range(options.decode_requests)]
    statuses = await _burst(options, model, short, options.decode_max_tokens)
    marks["decode_burst_done"] = time.time()
    await asyncio.sleep(options.settle_s)
    words = " ".join(f"word{j}" for j in range(options.prefill_prompt_words))
    long = [f"Summarize document {i}: {words}" for i in range(options.prefill_requests)]
    marks["prefill_burst_start"] = time.time()
    statuses += await _burst(options, model, long, options.prefill_max_tokens)
    marks["prefill_burst_done"] = time.time()
    await asyncio.sleep(options.settle_s)
    async with httpx.AsyncClient(timeout=30) as client:
        timeline = (await client.get(options.url + "/cluster/timeline",
                                     params={"since": started})).json()["samples"]
        flips = (await client.get(options.url + "/cluster")).json()["flips"] or []
    return {"options": asdict(options), "marks": marks,
            "requests_ok": sum(s == 200 for s in statuses), "requests": len(statuses),
            "flips": [f for f in flips if f["timestamp"] >= started], "timeline": timeline}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, t0 = result["timeline"], result["marks"]["start"]
    ids = sorted({i for s in samples for i in s["instances"]})
    fig, (roles_ax, queue_ax) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    colors = {"prefill": "tab:orange", "decode": "tab:blue"}
    for row, instance_id in enumerate(ids):
        for s in samples:
            inst = s["instances"].get(instance_id)
            if inst:
                color = "lightgray" if inst["draining"] else colors.get(inst["role"], "black")
                roles_ax.barh(row, 0.1, left=s["time"] - t0, color=color, height=0.6)
    roles_ax.set(yticks=range(len(ids)), yticklabels=ids, title="role of each instance "
                 "(orange prefill, blue decode, gray draining)")
    for role, key in (("prefill", "queued_tokens"), ("decode", "running")):
        totals = [sum(i[key] for i in s["instances"].values() if i["role"] == role)
                  for s in samples]
        queue_ax.plot([s["time"] - t0 for s in samples], totals,
                      label=f"{role}: {key.replace('_', ' ')}", color=colors[role])
    for name, t in result["marks"].items():
        queue_ax.axvline(t - t0, color="gray", linestyle=":")
        queue_ax.text(t - t0, queue_ax.get_ylim()[1] * 0.9, name, fontsize=7, rotation=90)
    queue_ax.set(xlabel="seconds", ylabel="load", yscale="symlog")
    queue_ax.set_ylim(bottom=0)
    queue_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_phase_shift(options: PhaseShiftOptions) -> dict:
    result = asyncio.run(_run(options))
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "phase_shift.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "phase_shift.png")
    for flip in result["flips"]:
        print(f"flip at +{flip['timestamp'] - result['marks']['start']:.1f} s: "
              f"{flip['instance_id']} {flip['from_role']} -> {flip['to_role']} "
              f"(drain {flip['drain_seconds'] * 1e3:.0f} ms, switch "
              f"{flip['switch_seconds'] * 1e3:.2f} ms)")
    print(f"{result['requests_ok']}/{result['requests']} requests ok; wrote {out}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, value in asdict(PhaseShiftOptions()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args()
    run_phase_shift(PhaseShiftOptions(**vars(args)))


if __name__ == "__main__":
    main()
