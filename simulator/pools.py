"""TetriInfer class pools: the (prompt, output) token lengths of bench's LPLD/LPHD/HPLD/HPHD
requests, tokenized once and resampled, so that simulations can draw more requests than the data
holds and need no tokenizer.

`splitserve bench`'s classes (bench.workloads.sample_workload) tokenize ShareGPT's bench range
each time (over a minute for a class), and the range holds only about 1,300 LPLD requests; a
simulation of a large cluster needs tens of thousands. A pool is the class's requests at seed 0,
lengths only (saved as JSON); `draw` resamples them with replacement under a seed, with
bench.workload's Poisson arrivals. Mixed is an equal share of the four classes in seeded order
(bench's own rule). Lengths count the tokens of the tokenizer the pools were built with
(`tokenizer` in the file), not necessarily the simulated model's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from common.config import ConfigError
from simulator.workload import SimRequest, arrivals

CLASSES = ("LPLD", "LPHD", "HPLD", "HPHD")  # bench.workloads.CLASSES (not imported: loads data)
WORKLOADS = CLASSES + ("Mixed",)
KIND = "splitserve-simulator-class-pools"


def build(tokenizer_path: str | None, cache_dir: str, size: int = 1000) -> dict:
    """Each class's requests (at most `size`, at seed 0) as bench would sample them."""
    from bench.run import BenchOptions, load_tokenizer
    from bench.workloads import sample_workload

    tokenizer = load_tokenizer(BenchOptions(tokenizer_path=tokenizer_path, cache_dir=cache_dir))
    pools = {}
    for cls in CLASSES:
        try:
            requests = sample_workload(tokenizer, cls, size, seed=0)
        except ConfigError as exc:  # the data holds fewer: take all it found
            found = re.search(r"'(\d+)/\d+'", str(exc))
            if found is None:
                raise
            requests = sample_workload(tokenizer, cls, int(found.group(1)), seed=0)
        pools[cls] = [[r.num_prompt_tokens, r.max_tokens] for r in requests]
    return {"kind": KIND, "tokenizer": tokenizer_path or "the default model", "size": size,
            "source": "bench.workloads.sample_workload(class, size, seed=0), ShareGPT bench "
                      "range", "pools": pools}


def save(data: dict, path: str | Path) -> Path:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return path


def load(path: str | Path) -> dict[str, list[tuple[int, int]]]:
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read class pools {path}: {exc}") from None
    if data.get("kind") != KIND:
        raise ConfigError(f"{path} is not a class-pool file (kind {data.get('kind')!r})")
    return {cls: [tuple(pair) for pair in data["pools"][cls]] for cls in CLASSES}


def load_or_build(path: str | Path, tokenizer_path: str | None = None,
                  cache_dir: str = "~/.cache/splitserve") -> dict[str, list[tuple[int, int]]]:
    """The pools at `path`, built and saved there first when missing (minutes: tokenizing)."""
    if not Path(path).expanduser().exists():
        save(build(tokenizer_path, cache_dir), path)
    return load(path)


def class_sequence(workload: str, num: int, rng: np.random.Generator) -> list[str]:
    """The class of each request: all `workload`, or Mixed's equal shares in seeded order."""
    if workload not in WORKLOADS:
        raise ConfigError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if workload != "Mixed":
        return [workload] * num
    base, extra = divmod(num, len(CLASSES))  # bench.workloads.class_quotas
    classes = [cls for i, cls in enumerate(CLASSES) for _ in range(base + (i < extra))]
    rng.shuffle(classes)
    return classes


def draw(pools: dict[str, list[tuple[int, int]]], workload: str, num: int, rate: float,
         seed: int) -> list[SimRequest]:
    """`num` requests of `workload` resampled from the pools, Poisson arrivals at `rate`."""
    rng = np.random.default_rng(seed + 7)  # apart from the arrival process's stream
    classes = class_sequence(workload, num, rng)
    times = arrivals(num, rate, seed)
    requests = []
    for i, (cls, t) in enumerate(zip(classes, times)):
        prompt, output = pools[cls][int(rng.integers(len(pools[cls])))]
        requests.append(SimRequest(f"r{i}", t, prompt, output, output, cls))
    return requests


def mean_lengths(pools: dict[str, list[tuple[int, int]]], workload: str) -> tuple[float, float]:
    """Mean prompt and output tokens of a workload's requests (Mixed: equal class shares)."""
    classes = CLASSES if workload == "Mixed" else (workload,)
    means = [np.mean(np.array(pools[cls], dtype=float), axis=0) for cls in classes]
    prompt, output = np.mean(means, axis=0)
    return float(prompt), float(output)
