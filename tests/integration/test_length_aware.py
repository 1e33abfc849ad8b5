"""Length-aware scheduling end to end: predictions travel with the sequence to the dispatcher
and the decode admission policy, and are scored against the realized lengths."""

from __future__ import annotations

import asyncio

import httpx
from cluster_fixture import Cluster, run_load
from prometheus_client.parser import text_string_to_metric_families


def _metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_oracle_predictions_with_power_of_two_and_reserve_dynamic(tmp_path, tiny_models):
    cluster = Cluster("--model", str(tiny_models["llama"]), "--decode", "2",
                      "--kv-memory-gib", "0.02", "--predictor", "oracle",
                      "--oracle-granularity", "20", "--heavy-threshold", "30",
                      "--dispatch-policy", "power_of_two", "--decode-admission", "reserve-dynamic",
                      "--local-prefill", "off", log_dir=tmp_path)  # every request predicted
    try:
        model = httpx.get(cluster.url + "/v1/models").json()["data"][0]["id"]
        outcomes = asyncio.run(run_load([cluster.url], 40, model, concurrency=20,
                                        max_tokens=(10, 60)))
        assert all(o["status"] == 200 and not o["error"] and o["tokens"] == o["want"]
                   for o in outcomes)
        decodes = [i for i in cluster.cluster()["instances"] if i["role"] == "decode"]
        scored = {outcome: sum(_metric(d["metrics_url"], "splitserve_length_predictions_total",
                                       outcome=outcome) for d in decodes)
                  for outcome in ("exact", "within_one", "miss")}
        # ignore-EOS requests run to max_tokens: the oracle's bucket is always exact
        assert scored == {"exact": 40, "within_one": 0, "miss": 0}
        assert all(_metric(d["metrics_url"], "splitserve_kv_transfer_seconds_count") > 0
                   for d in decodes), "power-of-two used both decode instances"
    finally:
        cluster.stop()
