"""`splitserve up` on a cache directory holding profile records of two thread counts: the
instances and the gateway take the one measured with the instances' threads, not the last one
written (common.profile_record)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
from cluster_fixture import Cluster

from common.engine.forward_log import read
from common.profile_record import PROFILE_RECORD, PROFILE_RECORDS, write_record

MODEL = "SmolLM2-135M-Instruct"


def curve(seconds_per_token: float) -> list[dict]:
    return [{"tokens": n, "seconds": n * seconds_per_token} for n in (16, 32, 64, 128, 256)]


def own_cache(tmp_path: Path) -> Path:
    """A cache directory with the shared cache's models and kernels and no record."""
    shared = Path(os.environ.get("SPLITSERVE_CACHE", "~/.cache/splitserve")).expanduser()
    cache = tmp_path / "cache"
    cache.mkdir()
    for entry in shared.iterdir() if shared.is_dir() else ():
        if entry.name not in (PROFILE_RECORD, PROFILE_RECORDS):
            (cache / entry.name).symlink_to(entry)
    return cache


def test_instances_and_gateway_read_the_record_of_the_instances_threads(tmp_path):
    cache = own_cache(tmp_path)
    for dtype in ("float32", "bfloat16"):  # whichever this CPU serves in
        # measured on 1 thread, as the instances run: ChunkSize 32, prefills up to 128 tokens
        # within the 0.1 s local prefill bound
        write_record(cache, {"model": MODEL, "dtype": dtype, "threads": 1,
                             "recommended_chunk_size": 32, "prefill": curve(0.0007)})
    for dtype in ("float32", "bfloat16"):  # then 2 threads, written last: 384 and 32 tokens
        write_record(cache, {"model": MODEL, "dtype": dtype, "threads": 2,
                             "recommended_chunk_size": 384, "prefill": curve(0.003)})
    logs = tmp_path / "forwards"
    cluster = Cluster("--cache-dir", str(cache), "--threads-per-instance", "1",
                      "--forward-log", str(logs), log_dir=tmp_path)
    try:
        instances = {i["role"]: i for i in cluster.cluster()["instances"]}
        assert instances["decode"]["threads"] == 1 and instances["prefill"]["threads"] == 1
        assert instances["decode"]["dtype"] in ("float32", "bfloat16")
        for length in (80, 300):  # 80 uncached tokens fit the 1-thread budget only
            response = httpx.post(cluster.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": list(range(1000, 1000 + length)), "max_tokens": 2})
            assert response.status_code == 200, response.text
        decode = next(i for i in cluster.cluster()["instances"] if i["role"] == "decode")
        assert decode["prefix_cache"]["local_prefills"] == 1
        prefill_id = instances["prefill"]["instance_id"]
        forwards = read(logs / f"{prefill_id}.jsonl")
        # the 300-token prompt in chunks of 32, not in one forward of 384
        assert forwards and max(f["shape"].tokens for f in forwards) == 32
    finally:
        cluster.stop()
