"""Cost models from PUBLISHED FIGURES, not from a measurement: a roofline estimate per GPU class.

No GPU run of `splitserve profile` was available when these were written; they are what the
datasheets and model cards say, with efficiency factors that are ASSUMPTIONS (stated below).
Replace them with a fitted profile (`splitserve simulate --profile FILE`) once a GPU run exists.

h100-llama2-7b: one NVIDIA H100 SXM5 80GB serving Llama-2-7B in float16.
- GPU (NVIDIA H100 Tensor Core GPU datasheet, SXM5): 989.4 TFLOP/s dense FP16/BF16 tensor
  (1,979 with sparsity), 3.35 TB/s HBM3, 80 GB.
- Model (Touvron et al. 2023, "Llama 2", and the model card): 6.74 B parameters, 32 layers,
  d_model 4096, 32 heads of 128 (no grouped-query attention), 4096-token context, 32,000-token
  vocabulary. Weights: 6.74e9 x 2 B = 13.48 GB. KV per token: 2 (K, V) x 32 layers x 4096 x
  2 B = 524,288 B.
- ASSUMED efficiencies: 60% of peak FLOP/s in large matmuls (what serving engines report for
  prefill on Hopper: roughly 50-70%), 80% of peak bandwidth when streaming weights or KV.
- ASSUMED 1 ms fixed time per forward (CPU-side scheduling, kernel launches; decode steps
  replayed as CUDA graphs make it smaller, Python schedulers larger) and 5 us per sampled row.
- Forward of T fresh tokens: 1 ms + max(weights / bandwidth, 2 x params x T / FLOP/s) + the
  prompt's own attention, T(T+1)/2 pairs x 4 x layers x d_model FLOPs.
- Attention over cached context: reading the KV (524,288 B per token at 80% of 3.35 TB/s:
  196 ns per token) and 4 x 32 x 4096 FLOPs per (new, cached) pair at 60% of peak (0.88 ns).
- KV capacity: 90% of 80 GB (vLLM's default gpu_memory_utilization) less the weights and 2 GB
  of activations and CUDA graphs (assumed): 56.5 GB, about 107,700 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import ConfigError
from simulator.costs import CostModel

BASE_SIZES = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
              4096, 6144, 8192)


@dataclass(frozen=True)
class GpuFigures:
    name: str
    peak_flops: float  # dense FP16/BF16 tensor FLOP/s
    memory_bytes_per_s: float
    memory_bytes: float


@dataclass(frozen=True)
class ModelFigures:
    name: str
    params: float
    layers: int
    d_model: int
    kv_dim: int  # KV heads x head dim (d_model without grouped-query attention)
    context: int
    bytes_per_param: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_dim * self.bytes_per_param

    @property
    def flops_per_pair(self) -> float:
        return 4.0 * self.layers * self.d_model  # QK^T and PV, 2 FLOPs per multiply-add


@dataclass(frozen=True)
class Assumptions:
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    forward_overhead_s: float = 1e-3
    per_sampled_row_s: float = 5e-6
    memory_utilization: float = 0.9
    activation_bytes: float = 2e9


H100_SXM = GpuFigures("NVIDIA H100 SXM5 80GB", 989.4e12, 3.35e12, 80e9)
LLAMA2_7B = ModelFigures("Llama-2-7B", 6.74e9, 32, 4096, 4096, 4096)


def roofline(gpu: GpuFigures, model: ModelFigures, assume: Assumptions = Assumptions(),
             default_link: str = "nvlink-300g") -> CostModel:
    flops = gpu.peak_flops * assume.flops_efficiency
    bandwidth = gpu.memory_bytes_per_s * assume.bandwidth_efficiency
    weights_s = model.weight_bytes / bandwidth
    pair_s = model.flops_per_pair / flops

    def fresh(tokens: int) -> float:
        matmul_s = 2.0 * model.params * tokens / flops
        return (assume.forward_overhead_s + max(weights_s, matmul_s)
                + pair_s * tokens * (tokens + 1) / 2)

    kv_bytes = (gpu.memory_bytes * assume.memory_utilization - model.weight_bytes
                - assume.activation_bytes)
    return CostModel(
        base=tuple((t, fresh(t)) for t in BASE_SIZES),
        per_sampled_row_s=assume.per_sampled_row_s,
        per_context_token_s=model.kv_bytes_per_token / bandwidth,
        per_context_pair_s=pair_s, kv_bytes_per_token=model.kv_bytes_per_token,
        max_model_len=model.context, kv_capacity_tokens=int(kv_bytes // model.kv_bytes_per_token),
        default_link=default_link,
        source=f"PUBLISHED FIGURES (roofline estimate, not measured): {gpu.name}, {model.name}",
        notes=("see simulator/hardware.py for every figure and its source",
               (f"assumed: {assume.flops_efficiency:.0%} of peak FLOP/s, "
                f"{assume.bandwidth_efficiency:.0%} of peak bandwidth, "
                f"{assume.forward_overhead_s * 1e3:g} ms per forward")))


HARDWARE = {"h100-llama2-7b": lambda: roofline(H100_SXM, LLAMA2_7B)}


def hardware_costs(name: str) -> CostModel:
    try:
        return HARDWARE[name]()
    except KeyError:
        raise ConfigError(f"unknown hardware profile {name!r}; known: {sorted(HARDWARE)}") from None
