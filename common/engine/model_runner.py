"""The model runner: loads one model and its KV cache, and executes `BatchPlan`s.

`execute(plan)` flattens the plan's chunks into one batch (one-token segments first, see
`common.engine.attention`), runs one forward, computes logits only for rows that are sampled, and
samples (after `common.engine.logits_process`); log-probabilities, of sampled and of prompt tokens,
come from the same forward (`common.engine.logprobs`). Constrained rows are masked by their
grammar just before sampling, and their matchers take the sampled tokens
(`common.engine.guided`). It never decides who runs; schedulers do.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from common.config import EngineConfig
from common.engine import cpu_features, guided, logits_process, logprobs
from common.engine.attention import Segment, TorchAttention
from common.engine.kv_cache import DTYPE_BY_NAME, KVCache, KVLayout
from common.engine.models import CausalLM, build_model
from common.engine.models.base import LayerTaps
from common.engine.models.layers import can_pack
from common.engine.ops import make_ops, skinny_kernels
from common.engine.sampler import Sampler
from common.engine.swap import HostSwapSpace, run_swaps
from common.engine.weights import iter_weights
from common.model_files import ResolvedModel, resolve_model
from common.plan import BatchPlan, ModelOutput

log = logging.getLogger(__name__)


@dataclass
class FlatBatch:
    """A plan flattened into rows: what one forward consumes."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    segments: list[Segment]
    sample_rows: list[int]  # rows whose logits are sampled
    sample_chunks: list  # the ScheduledChunk of each sampled row
    # (first row, chunk) of the prompt chunks asking for prompt log-probabilities
    prompt_chunks: list = field(default_factory=list)


def padded_rows(num_rows: int) -> int:
    """The row count a CPU forward is padded to: 1, 2, 4, then multiples of 8 up to 256, then of
    64. oneDNN compiles and keeps a matmul primitive per distinct row count (a few MB each, up to
    1,024 kept), so unbounded shapes (every prompt tail, every batch size) grow the process by
    hundreds of MB over hours; buckets bound that at a small set (vLLM pads decode batches to its
    CUDA-graph sizes the same way), for at most 7 (63 past 256) wasted rows."""
    if num_rows <= 4:
        return 1 << max(num_rows - 1, 0).bit_length()
    step = 8 if num_rows <= 256 else 64
    return -(-num_rows // step) * step


def kv_layout_for(model: CausalLM, config: EngineConfig, dtype: str) -> KVLayout:
    shape = model.shape
    layout = KVLayout(shape.num_layers, 1, config.cache.block_size, shape.num_kv_heads,
                      shape.head_dim, dtype)
    num_blocks = config.cache.num_blocks or int(config.cache.memory_gib * 2**30
                                                // layout.bytes_per_block)
    return layout.with_num_blocks(max(num_blocks, 1))


def attention_backend(device: torch.device, layout: KVLayout,
                      features: frozenset[str] = frozenset()):
    """On CUDA: flash-attn's paged varlen kernel when installed and blocks hold a multiple of
    256 tokens, else our Triton kernel when triton imports and takes the layout, else torch
    attention. On CPU: torch attention (with the C++ kernels where the ops have them).
    `features` (a sliding window, soft-capping: `CausalLM.fit_context`) only torch attention
    computes, so a model that needs one gets it on CUDA too."""
    if device.type != "cuda":
        return TorchAttention
    if features:
        log.warning("the model's attention needs %s, which the CUDA kernels lack: torch "
                    "attention on CUDA (no CUDA graphs)", ", ".join(sorted(features)))
        return TorchAttention
    from common.engine import attention_flash, attention_triton

    if attention_flash.available(layout.block_size):
        return attention_flash.FlashAttention
    if attention_triton.available(device, layout):
        return attention_triton.TritonAttention
    log.warning("no paged CUDA kernel (flash-attn: not installed or block_size %% 256 != 0; "
                "Triton: %s): torch attention on CUDA",
                attention_triton.unsupported_reason(layout) or "bfloat16 before sm_80")
    return TorchAttention


class ModelRunner:
    def __init__(self, config: EngineConfig, resolved: ResolvedModel | None = None) -> None:
        if config.model.num_threads:
            torch.set_num_threads(config.model.num_threads)
        self.num_threads = torch.get_num_threads()  # what a profile record must match
        self.config = config
        self.device = torch.device(config.model.device)
        self.resolved = resolved or resolve_model(config.model.path,
                                                  config.model.resolved_cache_dir)
        self.hf_config = self.resolved.read_config()
        self.dtype_name = config.model.resolved_dtype(cpu_features.default_cpu_dtype())
        self.model = build_model(self.hf_config, iter_weights(self.resolved.hf_dir),
                                 DTYPE_BY_NAME[self.dtype_name], str(self.device))
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        dtype = DTYPE_BY_NAME[self.dtype_name]
        # float32 asked for by name is the exact mode (transformers' op order, so the same tokens);
        # float32 chosen by "auto" (a CPU without native bfloat16) takes the fast path below.
        exact = config.model.dtype == "float32"
        # Packed weights run on oneDNN, whose per-shape primitives want bounded row counts.
        self.pad_shapes = can_pack(dtype, self.device, exact=exact)
        self.model.ops = make_ops(dtype, self.device, config.model.cache_dir, exact=exact)
        if self.pad_shapes:
            self.model.pack_for_cpu(skinny_kernels(self.model.ops, dtype))
        shape = self.model.shape
        self.max_model_len = min(config.model.max_model_len or shape.max_position_embeddings,
                                 shape.max_position_embeddings)
        layout = kv_layout_for(self.model, config, self.dtype_name)
        self.kv_cache = KVCache(layout, str(self.device), shared_memory=config.cache.shared_memory)
        self.sampler = Sampler(self.device, config.seed, kernels=self._sampling_kernels())
        # Windows no sequence can outgrow are dropped first: they would only cost the fast path.
        features = self.model.fit_context(self.max_model_len)
        self.attention_cls = attention_backend(self.device, layout, features)
        # Decode steps on CUDA replay captured graphs (common.engine.cuda_graphs); None on CPU.
        self.graphs = None
        if self.device.type == "cuda":
            from common.engine import cuda_graphs

            self.graphs = cuda_graphs.for_runner(self)
        # The second KV tier for plans that swap; a role that preempts by swap attaches one.
        self.swap_space: HostSwapSpace | None = None

    def _sampling_kernels(self):
        """The CPU kernels module for the sampler, also in the exact float32 mode (sampling
        does not touch the logits' arithmetic)."""
        if self.device.type != "cpu":
            return None
        from common.engine import cpu_kernels

        return cpu_kernels.load(self.config.model.cache_dir)

    @property
    def kv_layout(self) -> KVLayout:
        return self.kv_cache.layout

    def flatten(self, plan: BatchPlan) -> FlatBatch:
        # One-token chunks (decodes) first: attention batches them in one call.
        chunks = sorted(plan.chunks, key=lambda c: c.num_tokens != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        segments, sample_rows, sample_chunks, prompt_chunks = [], [], [], []
        for chunk in chunks:
            start = len(input_ids)
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.num_cached, chunk.num_cached + chunk.num_tokens))
            segments.append(Segment(start, chunk.num_tokens, chunk.num_cached, chunk.block_ids))
            if chunk.sampling is not None:
                sample_rows.append(len(input_ids) - 1)
                sample_chunks.append(chunk)
            if chunk.prompt_logprobs is not None:
                prompt_chunks.append((start, chunk))
        padding = plan.num_padding_tokens
        if self.pad_shapes:
            padding = max(padding, padded_rows(len(input_ids)) - len(input_ids))
        if padding:
            segments.append(Segment(len(input_ids), padding, 0, [], store=False))
            input_ids.extend([0] * padding)
            positions.extend(range(padding))
        as_tensor = lambda v: torch.tensor(v, dtype=torch.long, device=self.device)
        return FlatBatch(as_tensor(input_ids), as_tensor(positions), segments, sample_rows,
                         sample_chunks, prompt_chunks)

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> ModelOutput:
        started = time.perf_counter()
        # -- swap hook: the plan's KV copies to and from the host tier, before the forward --
        run_swaps(self.swap_space, self.kv_cache, plan)
        if not plan.chunks:  # a plan of swaps alone
            return ModelOutput(forward_seconds=time.perf_counter() - started)
        # -- end of swap hook ----------------------------------------------------------------
        batch = self.flatten(plan)
        if self.graphs is not None and self.graphs.can_run(plan, batch):
            taps, hidden = None, self.graphs.run(batch)  # a captured decode step
        else:
            attention = self.attention_cls(batch.segments, self.kv_cache, self.model.ops)
            taps = self._layer_taps(plan, batch)
            hidden = self.model(batch.input_ids, batch.positions, attention, taps)
        output = ModelOutput()
        if batch.sample_rows:
            sampled_hidden = hidden[batch.sample_rows]
            logits = self.model.compute_logits(sampled_hidden)
            processed = logits_process.process(logits, batch.sample_chunks)
            processed = guided.constrain(processed, batch.sample_chunks, logits,
                                         plan.return_logits)
            tokens = self.sampler(processed, [c.sampling for c in batch.sample_chunks],
                                  [c.num_output_tokens for c in batch.sample_chunks])
            guided.advance(batch.sample_chunks, tokens)
            output.logprobs = logprobs.of_sampled(logits, tokens, batch.sample_chunks)
            if plan.return_hidden:
                kept = self._kept_hidden(plan, sampled_hidden, taps)
            for i, (chunk, token) in enumerate(zip(batch.sample_chunks, tokens)):
                output.sampled_token_ids[chunk.seq_id] = token
                if plan.return_logits:
                    output.logits[chunk.seq_id] = logits[i].clone()
                if plan.return_hidden:
                    output.hidden[chunk.seq_id] = kept[i]
        output.prompt_logprobs = logprobs.of_prompts(hidden, batch.prompt_chunks,
                                                     self._padded_logits)
        output.forward_seconds = time.perf_counter() - started
        return output

    def _padded_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of extra rows (prompt log-probabilities), padded like a forward's rows where
        the packed CPU matmul keeps a primitive per row count."""
        rows = hidden.shape[0]
        if self.pad_shapes and padded_rows(rows) > rows:
            hidden = torch.nn.functional.pad(hidden, (0, 0, 0, padded_rows(rows) - rows))
        return self.model.compute_logits(hidden)[:rows]

    def _layer_taps(self, plan: BatchPlan, batch: FlatBatch) -> LayerTaps | None:
        if not (plan.return_hidden and plan.hidden_layers and batch.sample_rows):
            return None
        num_layers = self.model.shape.num_layers
        if any(not 0 <= layer <= num_layers for layer in plan.hidden_layers):
            raise ValueError(f"hidden_layers {plan.hidden_layers} outside 0..{num_layers}")
        return LayerTaps([layer for layer in plan.hidden_layers if layer < num_layers],
                         batch.sample_rows)

    def _kept_hidden(self, plan: BatchPlan, sampled_hidden: torch.Tensor,
                     taps: LayerTaps | None) -> torch.Tensor:
        """[rows, hidden] or [rows, len(hidden_layers), hidden] float32 on the CPU."""
        if taps is None:
            return sampled_hidden.float().cpu()
        final = self.model.shape.num_layers
        states = [sampled_hidden if layer == final else taps.states[layer]
                  for layer in plan.hidden_layers]
        return torch.stack(states, dim=1).float().cpu()

    def close(self) -> None:
        self.kv_cache.close()
