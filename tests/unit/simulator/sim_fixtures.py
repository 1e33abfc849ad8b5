"""A cost model with round numbers, small layouts and workloads for the simulator's tests."""

from __future__ import annotations

from dataclasses import replace

from common.config import (
    BatchConfig,
    CacheConfig,
    EmulationConfig,
    EngineConfig,
    GatewayConfig,
    InstanceConfig,
    PrefillConfig,
    RoutingConfig,
    TransferConfig,
)
from simulator.cluster import Layout
from simulator.costs import CostModel

# base(T) = 10 ms + 0.1 ms per token after the first; 1 ms per sampled row; 1 us per cached
# token read; 10 ns per (new, cached) pair; 1000 KV bytes per token
COSTS = CostModel(base=((1, 0.010), (1001, 0.110)), per_sampled_row_s=0.001,
                  per_context_token_s=1e-6, per_context_pair_s=1e-8, kv_bytes_per_token=1000,
                  max_model_len=4096, chunk_size=64, source="test")
BANDWIDTH, LATENCY = 1e6, 0.002  # the KV link: 1 MB/s, 2 ms


def instance_config(num_blocks: int = 256, chunk_size: int = 64, **fields) -> InstanceConfig:
    engine = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                          batch=BatchConfig(max_num_seqs=32, max_num_batched_tokens=512))
    transfer = TransferConfig(emulation=EmulationConfig(bandwidth=BANDWIDTH, latency_s=LATENCY))
    return InstanceConfig(engine=engine, prefill=PrefillConfig(chunk_size=chunk_size),
                          transfer=transfer, **fields)


def layout(num_prefill: int = 1, num_decode: int = 1, num_coupled: int = 0,
           instance: InstanceConfig | None = None, **gateway_fields) -> Layout:
    gateway = GatewayConfig(routing=RoutingConfig(local_prefill="off"), **gateway_fields)
    return Layout(num_prefill=num_prefill, num_decode=num_decode, num_coupled=num_coupled,
                  instance=instance or instance_config(), gateway=gateway)


def coupled(policy: str, **fields) -> Layout:
    return layout(0, 0, 2, replace(instance_config(**fields), coupled_policy=policy))
