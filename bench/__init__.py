"""Benchmarking splitserve and its baselines: workloads, the async load client, and metrics.

`bench.workload` builds requests (ShareGPT prompts) and arrival times, `bench.client` replays
them against any OpenAI-compatible server, `bench.metrics` turns the per-request records into
TTFT/TPOT/JCT/TBT and throughput, and `bench.run` ties them together for `splitserve bench`.
Nothing in this package imports torch, transformers or `common.engine`.
"""
