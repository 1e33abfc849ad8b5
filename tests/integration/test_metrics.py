"""Prometheus metrics of the gateway and of every instance, scraped after a real load."""

from __future__ import annotations

import asyncio

import httpx
from cluster_fixture import Cluster, run_load
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, list]:
    text = httpx.get(url + "/metrics", timeout=10).text
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples, name, **labels) -> float:
    return sum(s.value for s in samples.get(name, [])
               if all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_after_a_load(tmp_path, tiny_models):
    # every request through the prefill instance (busy there) and a transfer
    cluster = Cluster("--model", str(tiny_models["llama"]), "--kv-memory-gib", "0.1",
                      "--local-prefill", "off", log_dir=tmp_path)
    try:
        model = httpx.get(cluster.url + "/v1/models").json()["data"][0]["id"]
        outcomes = asyncio.run(run_load([cluster.url], 20, model, max_tokens=(5, 20)))
        sent_tokens = sum(o["want"] for o in outcomes)
        bad = httpx.post(cluster.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
        assert bad.status_code == 400
        gateway = scrape(cluster.url)
        assert value(gateway, "splitserve_requests_total", status="ok") == 20
        assert value(gateway, "splitserve_requests_total", status="rejected") == 1
        assert value(gateway, "splitserve_request_ttft_seconds_count") == 20
        assert value(gateway, "splitserve_request_jct_seconds_count") == 20
        assert value(gateway, "splitserve_request_tbt_seconds_count") == sent_tokens - 20
        assert value(gateway, "splitserve_generation_tokens_total") == sent_tokens
        assert value(gateway, "splitserve_instances", role="prefill") == 1
        assert value(gateway, "splitserve_instances", role="decode") == 1
        instances = cluster.cluster()["instances"]
        for inst in instances:
            assert httpx.get(inst["metrics_url"] + "/health").status_code == 200
            assert httpx.get(inst["metrics_url"] + "/ready").status_code == 200
            samples = scrape(inst["metrics_url"])
            for stage in ("prefill_waiting", "prefill_running", "transferring",
                          "decode_waiting", "decode_running"):
                assert len([s for s in samples["splitserve_queue_length"]
                            if s.labels["stage"] == stage]) == 1
            total = inst["kv_blocks"]["total"]
            assert value(samples, "splitserve_kv_blocks", state="free") + value(
                samples, "splitserve_kv_blocks", state="used") == total
            assert value(samples, "splitserve_busy_seconds_total") > 0
            assert value(samples, "splitserve_kv_integrity_violations_total") == 0
        decode = next(i for i in instances if i["role"] == "decode")
        decode_samples = scrape(decode["metrics_url"])
        # each request was handed over by a transfer or prefilled on the decode instance itself
        local = decode["prefix_cache"]["local_prefills"]
        assert value(decode_samples, "splitserve_kv_transfer_seconds_count") + local == 20
        assert value(decode_samples, "splitserve_prefix_cache_query_tokens_total") > 0
        assert value(decode_samples, "splitserve_kv_transfer_bytes_total") > 0
        assert value(decode_samples, "splitserve_kv_transfer_failures_total") == 0
    finally:
        cluster.stop()
